"""Ablation runner: config validation, aggregation and collapse on synthetic
results (exact numbers), and the whole path on the quick config: worker subprocesses, a failing
recipe, resume/skip, report, plots, MLflow."""

import json
import os
import math
from pathlib import Path

import pytest
import yaml

from prodrl_pipelines.lab.ablation_config import AblationConfig, AblationConfigError, CollapseRule, load_config
from prodrl_pipelines.lab.ablation_runner import run_ablation
from prodrl_pipelines.lab.ablation_stats import aggregate, check_claims, identical_pairs, paired_diffs
from prodrl_pipelines.lab.ablation_worker import FAIL_ENV

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "ablations" / "quick.yaml"
DEFAULT = REPO / "ablations" / "default.yaml"


def _write(tmp_path, cfg: dict, name="cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def _base_cfg(**kw) -> dict:
    d = {"name": "t", "rounds": 2, "seeds": [0, 1], "base": {"lab_size": "tiny", "heldout_size": 16},
         "recipes": {"a": {"correction": "tis"}, "b": {"correction": "score_centering"}},
         "comparisons": {"ab": ["a", "b"]}}
    d.update(kw)
    return d


# ------------------------------------------------------------------------------ config validation
@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["recipes"]["b"].update(corection="tis"), "recipe 'b': unknown setting(s) ['corection']"),
    (lambda d: d["recipes"]["b"].update(correction="bogus"), "recipe 'b': invalid settings"),
    (lambda d: d["recipes"]["a"].update(top_k=20), "recipe 'a': invalid settings"),  # head K=8 < top_k
    (lambda d: d["base"].update(learning_rate=-1), "recipe 'a': invalid settings: learning_rate"),
    (lambda d: d["base"].update(bogus_key=1), "base: unknown setting(s) ['bogus_key']"),
    (lambda d: d["recipes"]["a"].update(lab_size="huge"), "recipe 'a': invalid settings: lab_size: 'huge'"),
    (lambda d: d["recipes"]["a"].update(seed=3), "recipe 'a': ['seed'] are set by the runner"),
    (lambda d: d.update(comparisons={"x": ["a", "nope"]}), "comparison 'x': unknown recipe(s) ['nope']"),
    (lambda d: d.update(seeds=[]), "seeds"),
    (lambda d: d.update(seeds=[1, 1]), "seeds must be distinct"),
    (lambda d: d.update(rounds=0), "rounds"),
    (lambda d: d.update(extra_thing=1), "extra_thing"),
    (lambda d: d.update(name="../evil"), "name '../evil' must match"),
    (lambda d: d["recipes"].update({"bad name": {}}), "recipe name 'bad name'"),
    (lambda d: d.update(claims=[{"text": "t", "lhs": "a", "op": ">", "rhs": "zz"}]), "unknown recipe 'zz'"),
    (lambda d: d.update(claims=[{"text": "t", "lhs": "a", "op": ">", "rhs": "b", "metric": "nope"}]), "metric"),
])
def test_config_validation_names_the_problem(tmp_path, mutate, expected):
    d = _base_cfg()
    mutate(d)
    with pytest.raises(AblationConfigError) as e:
        load_config(_write(tmp_path, d))
    assert expected in str(e.value)


def test_config_missing_file_and_cli_exit_code(tmp_path, capsys):
    from prodrl_pipelines.cli.main import main

    with pytest.raises(AblationConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    d = _base_cfg()
    d["recipes"]["b"]["correction"] = "bogus"
    assert main(["lab", "ablate", "--config", str(_write(tmp_path, d)), "--runs-dir", str(tmp_path / "r")]) == 2
    assert "recipe 'b'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # nothing started


def test_seeds_set_seed_and_lab_seed_and_quick_shrinks():
    cfg = load_config(DEFAULT)
    s = cfg.settings_for("tis", 2)
    assert s["seed"] == 2 and s["lab_seed"] == 2
    q = load_config(DEFAULT, quick=True)
    assert q.name == f"{cfg.name}-quick" and q.seeds == cfg.seeds[:1] and q.rounds <= 2
    assert q.base["lab_size"] == "tiny" and set(q.recipes) == set(cfg.recipes)
    only = load_config(DEFAULT, recipes=["tis", "tis_retokenized"], seeds=[5])
    assert list(only.recipes) == ["tis", "tis_retokenized"] and only.seeds == [5]
    assert list(only.comparisons) == ["replay (recorded vs retokenized ids)"]


def test_default_config_covers_the_issue():
    cfg = load_config(DEFAULT)
    assert len(cfg.seeds) >= 3
    by = {r: {**cfg.base, **o} for r, o in cfg.recipes.items()}
    assert {by[r].get("replay", "recorded") for r in by} == {"recorded", "retokenized"}
    assert {"tis", "ref_is", "score_centering", "cis"} <= {by[r].get("correction") for r in by}
    assert any(o.get("top_p") == 0.95 and o.get("top_k") == 20 for o in by.values())
    assert any(o.get("max_policy_lag") == 1 for o in by.values())
    assert any(o.get("kl_beta", 0) > 0 for o in by.values())
    assert len(cfg.comparisons) >= 5 and len(cfg.claims) >= 3


# ------------------------------------------------------------------------------ aggregation
def _res(recipe, seed, rewards, gates=None, mism=None):
    rounds = []
    for i, y in enumerate(rewards):
        rounds.append({"round": i, "heldout_reward": y, "heldout_reward_ci": 0.01,
                       "gate_passed": True if i == 0 else (gates[i - 1] if gates else True),
                       "deployed": True, "mismatch_abs_logp": None if i == 0 else (mism or [0.1] * 9)[i - 1]})
    return {"recipe": recipe, "seed": seed, "rounds": rounds, "wall_s": 60.0 * (seed + 1)}


def test_collapse_rule():
    rule = CollapseRule(below_base=0.05, drop_from_best=0.10)
    assert not rule.collapsed([0.3, 0.4, 0.5])
    assert rule.collapsed([0.3, 0.3, 0.24])  # 0.06 below base
    assert not rule.collapsed([0.3, 0.3, 0.26])  # within 0.05 of base
    assert rule.collapsed([0.3, 0.6, 0.45])  # 0.15 below its best
    assert not rule.collapsed([0.3, 0.6, 0.55])
    assert not rule.collapsed([0.3])  # no rounds
    assert not rule.collapsed([0.3, float("nan"), 0.35])


def test_aggregate_exact_numbers():
    cfg = AblationConfig(**_base_cfg(seeds=[0, 1, 2]))
    results = [
        _res("a", 0, [0.3, 0.4, 0.5], mism=[0.1, 0.3]),
        _res("a", 1, [0.3, 0.5, 0.45], gates=[True, False], mism=[0.2, 0.2]),
        _res("a", 2, [0.2, 0.1, 0.1], gates=[False, False], mism=[0.4, 0.0]),
        _res("b", 0, [0.3, 0.6, 0.45]),
        _res("b", 1, [0.3, 0.5, 0.5]),
    ]
    t = aggregate(cfg, results, failures=[{"recipe": "b", "seed": 2, "error": "x"}])
    a, b = t["a"], t["b"]
    assert a["seeds_ok"] == 3 and a["seeds_failed"] == 0 and b["seeds_ok"] == 2 and b["seeds_failed"] == 1
    assert b["seeds_missing"] == 0
    assert aggregate(cfg, results, [{"recipe": "b", "seed": 2, "missing": True}])["b"]["seeds_missing"] == 1
    assert a["final_mean"] == pytest.approx((0.5 + 0.45 + 0.1) / 3)
    mean = (0.5 + 0.45 + 0.1) / 3
    assert a["final_sd"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in (0.5, 0.45, 0.1)) / 2))
    assert a["best_mean"] == pytest.approx((0.5 + 0.5 + 0.1) / 3)
    assert a["auc_mean"] == pytest.approx((0.45 + 0.475 + 0.1) / 3)
    assert a["worst_mean"] == pytest.approx((0.4 + 0.45 + 0.1) / 3)
    gains = (0.2, 0.15, -0.1)
    gm = sum(gains) / 3
    assert a["gain_sd"] == pytest.approx(math.sqrt(sum((g - gm) ** 2 for g in gains) / 2))
    assert a["jitter_mean"] == pytest.approx((0.1 + 0.05 + 0.0) / 3)
    assert a["base_mean"] == pytest.approx(0.8 / 3)
    assert a["gain_mean"] == pytest.approx((0.2 + 0.15 - 0.1) / 3)
    assert a["collapsed"] == 1  # seed 2: 0.1 < 0.2 - 0.05
    assert a["gate_failures"] == 3
    assert a["mismatch_mean"] == pytest.approx((0.1 + 0.3 + 0.2 + 0.2 + 0.4 + 0.0) / 6)
    assert a["final_min"] == pytest.approx(0.1) and a["final_max"] == pytest.approx(0.5)
    assert b["final_mean"] == pytest.approx(0.475) and b["final_sd"] == pytest.approx(math.sqrt(2 * 0.025 ** 2))
    assert b["collapsed"] == 1  # seed 0: 0.45 < 0.6 - 0.1
    assert paired_diffs(results, "b", "a") == pytest.approx([-0.05, 0.05])
    assert identical_pairs(cfg, results) == []
    assert identical_pairs(cfg, results + [_res("c", 0, [0.3, 0.4, 0.5])]) == []  # c is in no comparison
    cfg3 = AblationConfig(**_base_cfg(seeds=[0, 1, 2], recipes={"a": {}, "b": {}, "c": {"kl_beta": 0.1}},
                                      comparisons={"x": ["a", "c"], "y": ["b", "c"]}))
    same = [_res("c", 0, [0.3, 0.4, 0.5]), _res("c", 1, [0.3, 0.5, 0.45])]
    assert identical_pairs(cfg3, results + same) == [("a", "c", 2)]

    cfg2 = AblationConfig(**_base_cfg(seeds=[0, 1, 2], claims=[
        {"text": "b at least matches a", "lhs": "b", "op": ">=", "rhs": "a", "metric": "final_mean"},
        {"text": "b less variable", "lhs": "b", "op": "<", "rhs": "a", "metric": "final_sd"},
        {"text": "a better by 0.2", "lhs": "a", "op": ">", "rhs": "b", "metric": "final_mean", "margin": 0.2},
    ]))
    c = check_claims(cfg2, t)
    assert [x["holds"] for x in c] == [True, True, False]
    assert c[0]["lhs_value"] == pytest.approx(0.475)
    # a recipe without runs: no data, not a verdict
    t["b"]["final_mean"] = float("nan")
    assert check_claims(cfg2, t)[0]["holds"] is None


# ------------------------------------------------------------------------------ end to end (quick)
@pytest.mark.long(seconds=90)
def test_quick_ablation_end_to_end(tmp_path, monkeypatch, capsys):
    """2 recipes + 1 failing recipe + retokenized replay on the task in production text (its own base),
    1 seed, 1 round (tiny): real worker subprocesses, then a rerun."""
    from mlflow.tracking import MlflowClient

    from prodrl_pipelines.cli.main import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = yaml.safe_load(QUICK.read_text())
    cfg["recipes"]["broken"] = {"correction": "cis"}
    cfg["comparisons"]["with_broken"] = ["tis", "broken"]
    cfg["recipes"]["tools_retokenized"] = {"correction": "tis", "replay": "retokenized", "lab_task": "arithmetic_tools",
                                           "max_tokens": 40}
    path = _write(tmp_path, cfg, "quick.yaml")
    monkeypatch.setenv(FAIL_ENV, "broken")
    runs = tmp_path / "runs"
    rc = main(["lab", "ablate", "--config", str(path), "--runs-dir", str(runs), "--workers", "2"])
    assert rc == 1  # one recipe failed; the others finished
    root = runs / "quick"
    for rec in ("tis", "score_centering"):
        res = json.loads((root / "runs" / rec / "seed0" / "result.json").read_text())
        assert res["status"] == "ok" and [r["round"] for r in res["rounds"]] == [0, 1]
        assert res["settings"]["seed"] == 0 and res["settings"]["lab_size"] == "tiny"
        assert all(math.isfinite(r["heldout_reward"]) for r in res["rounds"])
    tools = json.loads((root / "runs" / "tools_retokenized" / "seed0" / "result.json").read_text())
    assert tools["status"] == "ok" and tools["settings"]["lab_task"] == "arithmetic_tools"
    assert 0 < tools["retokenize"]["retokenized_calls_differ"] <= tools["retokenize"]["retokenized_calls"]
    # one SFT base per seed and lab task, copied into each run's home (its bootstrap only exports/evaluates/registers it)
    bases = {json.loads((b / "warm_start.json").read_text())["task"]: b for b in (root / "bases").glob("*/round-000000")}
    assert set(bases) == {"arithmetic", "arithmetic_tools"}
    base = bases["arithmetic"]
    for rec in ("tis", "score_centering"):
        ckpt = root / "runs" / rec / "seed0" / "home" / "checkpoints" / "round-000000"
        assert (ckpt / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
        assert (ckpt / "warm_start.json").read_text() == (base / "warm_start.json").read_text()
    failed = json.loads((root / "runs" / "broken" / "seed0" / "failed.json").read_text())
    assert "injected failure" in failed["error"] and Path(failed["log"]).exists()

    report = (root / "report.md").read_text()
    assert ("| recipe | seeds | base | final mean ± sd | best mean | worst mean | mean rounds>=1 | sd(gain) | jitter |"
            in report)
    for rec in ("tis", "score_centering", "broken", "tools_retokenized"):
        assert f"| {rec} |" in report
    assert "`tools_retokenized` rebuilt" in report
    assert "## Failed or missing runs" in report and "injected failure" in report
    assert "score centering at least matches IS" in report
    pngs = sorted((root / "plots").glob("*.png"))
    assert {p.name for p in pngs} >= {"corrections.png", "with_broken.png", "final_reward_by_recipe.png",
                                      "engine_mismatch.png"}
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{p.name})" in report
    lines = (root / "results.csv").read_text().splitlines()
    assert lines[0].startswith("recipe,seed,round,heldout_reward") and len(lines) == 1 + 3 * 2
    doc = json.loads((root / "results.json").read_text())
    assert set(doc["table"]) == {"tis", "score_centering", "broken", "tools_retokenized"}

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ablation/quick")
    (run,) = client.search_runs([exp.experiment_id])
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.md", "results.csv", "results.json", "config.json", "plots"} <= arts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} >= {"plots/corrections.png"}
    assert "tis.final_mean" in run.data.metrics
    assert [m.step for m in client.get_metric_history(run.info.run_id, "tis.heldout_reward_mean")] == [0, 1]

    # rerun: finished runs are skipped (result.json), the failed one is retried (and fails again)
    before = {rec: (root / "runs" / rec / "seed0" / "result.json").stat().st_mtime_ns
              for rec in ("tis", "score_centering")}
    out = run_ablation(load_config(path), root, workers=2, progress=False, log=lambda m: None)
    assert (out.skipped, out.ran, out.failed) == (3, 0, 1)
    assert before == {rec: (root / "runs" / rec / "seed0" / "result.json").stat().st_mtime_ns for rec in before}


def test_resume_skips_only_matching_results(tmp_path, monkeypatch):
    """result.json made with the same settings and rounds is skipped; one from other settings is set
    aside (result.stale.json) and the run goes again (here: an injected failure, no real training)."""
    from prodrl_pipelines.lab.ablation_runner import base_policy_key, run_dir

    cfg = AblationConfig(**_base_cfg(seeds=[0], rounds=1))
    root = tmp_path / "abl"
    for rec in ("a", "b"):
        s = cfg.settings_for(rec, 0)
        (root / "bases" / base_policy_key(s) / "round-000000").mkdir(parents=True, exist_ok=True)
        (root / "bases" / base_policy_key(s) / "round-000000" / "config.json").write_text("{}")  # no base build
        if rec == "b":
            s = {**s, "learning_rate": 1.0}  # made with other settings
        d = run_dir(root, rec, 0)
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps({**_res(rec, 0, [0.3, 0.4]), "settings": s}))
    monkeypatch.setenv(FAIL_ENV, "a,b")
    msgs = []
    out = run_ablation(cfg, root, workers=2, progress=False, log=msgs.append)
    assert (out.skipped, out.ran, out.failed) == (1, 0, 1)
    assert (run_dir(root, "a", 0) / "result.json").exists()
    assert (run_dir(root, "b", 0) / "result.stale.json").exists()
    assert not (run_dir(root, "b", 0) / "result.json").exists()
    assert "injected failure" in json.loads((run_dir(root, "b", 0) / "failed.json").read_text())["error"]
    assert any("other settings or rounds" in m for m in msgs)


def test_report_from_synthetic_results(tmp_path, monkeypatch):
    """write_report + log_to_mlflow on synthetic result documents (no runs): table, claims, notes, plots."""
    from mlflow.tracking import MlflowClient

    from prodrl_pipelines.lab.ablation_report import log_to_mlflow, write_report

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = AblationConfig(**_base_cfg(seeds=[0, 1], recipes={"a": {}, "b": {"kl_beta": 0.1}, "c": {"kl_beta": 1.0}},
                                     comparisons={"ab": ["a", "b"], "bc": ["b", "c"]}, claims=[
        {"text": "c beats a", "lhs": "c", "op": ">", "rhs": "a", "metric": "final_mean"}]))
    results = [_res("a", 0, [0.3, 0.4, 0.5]), _res("a", 1, [0.3, 0.5, 0.45]),
               _res("b", 0, [0.3, 0.4, 0.5]), _res("b", 1, [0.3, 0.5, 0.45]),
               _res("c", 0, [0.3, 0.6, 0.6])]
    results[4]["retokenize"] = {"retokenized_calls": 200, "retokenized_calls_differ": 10, "retokenized_multi_turn_calls": 80,
                                "retokenized_multi_turn_calls_differ": 9, "retokenized_tokens_differ": 35}
    failures = [{"recipe": "c", "seed": 1, "error": "RuntimeError: boom\ntraceback...", "log": "/x/run.log"}]
    rep = write_report(cfg, tmp_path, results, failures, wall_s=125.0)
    md = rep["report"].read_text()
    assert "2 seed(s) [0, 1], 2 rounds each; 5 runs finished, 1 failed, 0 not run; runner wall time 2.1 min" in md
    assert "| a | 2 | 0.300 | 0.475 ± 0.035 | 0.500 | 0.425 | 0.463 | 0.035 | 0.075 | 0/2 | 0 | 0.1000 | 1.5 (-) |" in md
    assert "| c | 1 (+1 failed) |" in md
    assert "- c beats a: **holds** — final_mean `c` 0.600 > `a` 0.475; per-seed final differences c - a: +0.100" in md
    assert "`a` = `b` (2 seeds)" in md and "`b` = `c`" not in md
    assert "- `c` seed 1: RuntimeError: boom (log: `/x/run.log`)" in md
    assert ("`c` rebuilt 10 of 200 calls with ids different from the recorded ones (9 of 80 multi-turn calls; "
            "3.5 differing tokens per differing call).") in md
    assert {p.name for p in rep["plots"]} == {"ab.png", "bc.png", "final_reward_by_recipe.png", "engine_mismatch.png"}
    uri, rid = log_to_mlflow(cfg, tmp_path, rep)
    run = MlflowClient(uri).get_run(rid)
    assert run.data.metrics["a.final_mean"] == pytest.approx(0.475) and run.data.params["seeds"] == "[0, 1]"


def _pids_with(fragment: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if fragment in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def test_sigterm_to_the_runner_stops_its_runs(tmp_path):
    """`kill <runner>` must not leave a run behind that would race the rerun in the same home."""
    import signal
    import subprocess
    import sys
    import time

    runs = tmp_path / "runs"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    runner = subprocess.Popen([sys.executable, "-m", "prodrl_pipelines.cli", "lab", "ablate", "--config",
                               "ablations/quick.yaml", "--runs-dir", str(runs), "--no-mlflow", "--workers", "1",
                               "--rounds", "200"],  # a run that outlives the checks below
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300  # ceilings: the base build and a run's start are slow on a loaded machine
        workers: list[int] = []
        while time.time() < deadline and not workers:  # a run (not the quick base build, which ends fast)
            workers = _pids_with(f"_worker {runs}/quick/runs/")
            time.sleep(0.2)
        assert workers, "no run subprocess started"
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=180) != 0
        deadline = time.time() + 120
        while time.time() < deadline and _pids_with(f"_worker {runs}"):
            time.sleep(0.2)
        assert _pids_with(f"_worker {runs}") == []
    finally:
        if runner.poll() is None:
            runner.kill()
        for pid in _pids_with(f"_worker {runs}"):
            os.kill(pid, signal.SIGKILL)
