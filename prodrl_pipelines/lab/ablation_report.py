"""The report of an ablation under its root: ``report.md`` (table, claims, notes, plots),
``results.csv`` (one row per recipe, seed and round), ``results.json``, ``plots/*.png``, and the same
logged to MLflow as one run of experiment ``ablation/<name>`` (tracking URI ``MLFLOW_TRACKING_URI`` or
``sqlite:///<root>/mlflow.db``)."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import time
from pathlib import Path

from prodrl_pipelines.lab.ablation_config import METRICS, AblationConfig
from prodrl_pipelines.lab.ablation_stats import (aggregate, check_claims, curve, finite_mean, identical_pairs,
                                                 paired_diffs)
from prodrl_pipelines.storage.atomic import write_json_atomic


def _f(x, nd=3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


TABLE_COLUMNS = ["recipe", "seeds", "base", "final mean ± sd", "best mean", "worst mean", "mean rounds>=1",
                 "sd(gain)", "jitter", "collapsed", "gate failures", "engine mismatch", "min/run (CPU)"]


def table_rows(table: dict[str, dict]) -> list[list[str]]:
    """The aggregated table as text cells under ``TABLE_COLUMNS`` (the report's table and the CLI's)."""
    rows = []
    for r in table.values():
        extra = [f"+{r['seeds_failed']} failed"] * bool(r["seeds_failed"]) + \
            [f"+{r.get('seeds_missing', 0)} not run"] * bool(r.get("seeds_missing"))
        seeds = f"{r['seeds_ok']}" + (f" ({', '.join(extra)})" if extra else "")
        rows.append([r["recipe"], seeds, _f(r["base_mean"]), f"{_f(r['final_mean'])} ± {_f(r['final_sd'])}",
                     _f(r["best_mean"]), _f(r["worst_mean"]), _f(r["auc_mean"]), _f(r["gain_sd"]),
                     _f(r["jitter_mean"]),
                     f"{r['collapsed']}/{r['seeds_ok']}",
                     str(r["gate_failures"]), _f(r["mismatch_mean"], 4),
                     f"{_f(r['wall_s_mean'] / 60, 1)} ({_f(r['cpu_s_mean'] / 60, 1)})"])
    return rows


def write_report(cfg: AblationConfig, root: Path, results: list[dict], failures: list[dict],
                 wall_s: float | None = None) -> dict:
    """report.md, results.csv, results.json and plots/ under ``root``; returns paths and the table."""
    from prodrl_pipelines.lab.ablation_plots import comparison_png, finals_png

    root = Path(root)
    table = aggregate(cfg, results, failures)
    claims = check_claims(cfg, table)
    plots = root / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    curves = {rec: {r["seed"]: curve(r) for r in results if r["recipe"] == rec} for rec in cfg.recipes}
    plot_files: dict[str, Path] = {}
    groups = dict(cfg.comparisons) or {"all recipes": list(cfg.recipes)}
    for cname, members in groups.items():
        fn = plots / f"{_slug(cname)}.png"
        fn.write_bytes(comparison_png({m: curves[m] for m in members}, title=f"{cname}: held-out reward"))
        plot_files[cname] = fn
    mism = {rec: {r["seed"]: [x.get("mismatch_abs_logp") if x.get("mismatch_abs_logp") is not None else float("nan")
                              for x in sorted(r["rounds"], key=lambda x: x["round"])]
                  for r in results if r["recipe"] == rec} for rec in cfg.recipes}
    mm = plots / "engine_mismatch.png"
    mm.write_bytes(comparison_png(mism, title="engine mismatch mean |log pi_k - log mu| per round",
                                  ylabel="|log pi_k - log mu|"))
    fin = plots / "final_reward_by_recipe.png"
    fin.write_bytes(finals_png({m: [c[-1] for c in curves[m].values()] for m in cfg.recipes},
                               {m: [c[0] for c in curves[m].values()] for m in cfg.recipes}))

    # results.csv: one row per (recipe, seed, round)
    with open(root / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["recipe", "seed", "round", "heldout_reward", "heldout_reward_ci", "gate_passed", "deployed",
                    "mismatch_abs_logp"])
        for r in sorted(results, key=lambda r: (r["recipe"], r["seed"])):
            for x in r["rounds"]:
                w.writerow([r["recipe"], r["seed"], x["round"], x.get("heldout_reward"), x.get("heldout_reward_ci"),
                            x.get("gate_passed"), x.get("deployed"), x.get("mismatch_abs_logp")])
    doc = {"name": cfg.name, "config": cfg.model_dump(), "table": table, "claims": claims, "failures": failures,
           "runs": [{k: r.get(k) for k in ("recipe", "seed", "wall_s", "cpu_s", "round_wall_s", "rounds", "retokenize")}
                    for r in results],
           "wall_s": wall_s}
    write_json_atomic(root / "results.json", doc)

    L = [f"# Ablation `{cfg.name}`", ""]
    L.append(f"{len(cfg.recipes)} recipes x {len(cfg.seeds)} seed(s) {cfg.seeds}, {cfg.rounds} rounds each; "
             f"{len(results)} runs finished, {sum(not f.get('missing') for f in failures)} failed, "
             f"{sum(bool(f.get('missing')) for f in failures)} not run"
             + (f"; runner wall time {wall_s / 60:.1f} min." if wall_s else "."))
    L.append("")
    L.append("Base settings: `" + json.dumps(cfg.base, sort_keys=True) + "`. Seed k sets `seed` and `lab_seed` "
             "(every recipe of a seed starts from the same base policy). Held-out reward = the candidate's "
             "mean reward on the held-out tasks after each round (round 0 = base policy), whether or not "
             "the gate deployed it.")
    L += ["", "## Results", ""]
    L.append("| " + " | ".join(TABLE_COLUMNS) + " |")
    L.append("|" + "---|" * len(TABLE_COLUMNS))
    for row in table_rows(table):
        L.append("| " + " | ".join(row) + " |")
    L += ["", f"final = held-out reward after round {cfg.rounds}; best / worst = max / min over rounds "
          f"1..{cfg.rounds} (per seed, then averaged); sd = sample sd across seeds; sd(gain) = sd across seeds "
          "of final - base (the spread net of each seed's own base policy); jitter = mean abs change of the "
          "reward between consecutive rounds from round 2 on (plateau stability), averaged over seeds; "
          "collapsed: final < base - "
          f"{cfg.collapse.below_base} or final < best - {cfg.collapse.drop_from_best} (per seed); gate failures: "
          "rounds whose candidate the gate refused (all seeds); engine mismatch = mean over rounds and seeds of "
          "mean abs(log pi_k - log mu) on the round's data; min/run = wall minutes per run (CPU minutes).", ""]
    L += ["## Recipes", ""]
    for rec, ov in cfg.recipes.items():
        L.append(f"- `{rec}`: `{json.dumps(ov or {}, sort_keys=True)}`")
    if claims:
        L += ["", "## Claims, checked on these numbers", ""]
        for c in claims:
            verdict = {True: "**holds**", False: "**does not hold**", None: "**no data**"}[c["holds"]]
            diffs = paired_diffs(results, c["lhs"], c["rhs"]) if c["metric"] in ("final_mean", "gain_mean") else []
            extra = (f"; per-seed final differences {c['lhs']} - {c['rhs']}: "
                     + ", ".join(f"{d:+.3f}" for d in diffs)) if diffs else ""
            m = f" {c['margin']:+g}" if c["margin"] else ""
            L.append(f"- {c['text']}: {verdict} — {c['metric']} `{c['lhs']}` {_f(c['lhs_value'])} {c['op']} "
                     f"`{c['rhs']}` {_f(c['rhs_value'])}{m}{extra}")
    same = identical_pairs(cfg, results)
    if same:
        L += ["", "Identical held-out curves (equal to 1e-9 at every round of every seed both finished, so "
              "these settings did not change the measured outcome here): "
              + "; ".join(f"`{a}` = `{b}` ({n} seed{'s' if n > 1 else ''})" for a, b, n in same) + "."]
    retok = {k: v for k, v in table.items() if v["retokenized_calls"]}
    if retok:
        L += ["", "Retokenized replay: " + "; ".join(
            f"`{k}` rebuilt {v['retokenized_calls_differ']} of {v['retokenized_calls']} calls with ids different "
            f"from the recorded ones ({v['retokenized_multi_turn_calls_differ']} of "
            f"{v['retokenized_multi_turn_calls']} multi-turn calls; "
            f"{v['retokenized_tokens_differ'] / max(v['retokenized_calls_differ'], 1):.1f} differing tokens per "
            "differing call)" for k, v in retok.items())
            + (" — the lab's tokenizer round-trips its own outputs exactly, so retokenization changes nothing "
               "here and the curves coincide." if all(v["retokenized_calls_differ"] == 0 for v in retok.values())
               else ".")]
    L += ["", "## Plots", "", "Mean over seeds (thick line), min-max band over seeds (shaded), each seed (thin).", ""]
    for cname, fn in plot_files.items():
        L.append(f"### {cname}\n\n![{cname}](plots/{fn.name})\n")
    L.append(f"### final held-out reward by recipe\n\n![final](plots/{fin.name})\n")
    L.append(f"### engine mismatch by recipe\n\n![mismatch](plots/{mm.name})\n")
    if failures:
        L += ["## Failed or missing runs", ""]
        for f in failures:
            L.append(f"- `{f['recipe']}` seed {f['seed']}: {str(f.get('error', '')).splitlines()[0][:300]}"
                     + (f" (log: `{f['log']}`)" if f.get("log") else ""))
        L.append("")
    L += ["## Runs", "", "Each run's home (Dagster SQLite instance, MLflow, stores, checkpoints) is "
          "`runs/<recipe>/seed<k>/home`; its log `runs/<recipe>/seed<k>/run.log`; per-round numbers in "
          "`results.csv`.", ""]
    (root / "report.md").write_text("\n".join(L) + "\n")
    return {"report": root / "report.md", "csv": root / "results.csv", "json": root / "results.json",
            "plots": sorted(plots.glob("*.png")), "table": table, "claims": claims}


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_").lower() or "plot"


def log_to_mlflow(cfg: AblationConfig, root: Path, rep: dict, tracking_uri: str | None = None) -> tuple[str, str]:
    """One MLflow run in experiment ``ablation/<name>``: params, per-recipe metrics (and mean curves
    as step metrics), the report, plots, CSV/JSON as artifacts. Returns (tracking_uri, run_id)."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=uri)
    exp_name = f"ablation/{cfg.name}"
    exp = client.get_experiment_by_name(exp_name)
    if exp is None:
        art = None if uri.startswith("http") else (root / "mlartifacts").resolve().as_uri()
        exp_id = client.create_experiment(exp_name, artifact_location=art)
    else:
        exp_id = exp.experiment_id
    run = client.create_run(exp_id, run_name=cfg.name, tags={"prodrl.ablation": cfg.name})
    rid = run.info.run_id
    params = [Param("rounds", str(cfg.rounds)), Param("seeds", json.dumps(cfg.seeds)),
              Param("recipes", ",".join(cfg.recipes)), Param("base", json.dumps(cfg.base, sort_keys=True)[:6000])]
    params += [Param(f"recipe.{k}", json.dumps(v or {}, sort_keys=True)[:6000]) for k, v in cfg.recipes.items()]
    client.log_batch(rid, params=params)
    ts = int(time.time() * 1000)
    ms = []
    for rec, row in rep["table"].items():
        for k in METRICS:
            v = row[k]
            if isinstance(v, (int, float)) and math.isfinite(v):
                ms.append(Metric(f"{rec}.{k}", float(v), ts, 0))
    res = json.loads(rep["json"].read_text())["runs"]
    for rec in cfg.recipes:
        cs = [curve(r) for r in res if r["recipe"] == rec]
        for i in range(max((len(c) for c in cs), default=0)):
            m = finite_mean([c[i] for c in cs if i < len(c)])
            if math.isfinite(m):
                ms.append(Metric(f"{rec}.heldout_reward_mean", m, ts, i))
    for i in range(0, len(ms), 900):
        client.log_batch(rid, metrics=ms[i:i + 900])
    for p in [rep["report"], rep["csv"], rep["json"], root / "config.json"]:
        if not p.exists():
            continue
        client.log_artifact(rid, str(p))
    for p in rep["plots"]:
        client.log_artifact(rid, str(p), artifact_path="plots")
    client.set_terminated(rid)
    return uri, rid
