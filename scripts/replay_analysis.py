"""What retokenized replay trained on, measured on an ablation's runs (docs/ablations/replay/).

For every run of a recipe with ``replay: retokenized`` and every round k it reads the round's dataset
(the rebuilt ids the trainer used), the recorded calls (what the deployment consumed and sampled) and
the round-start policy pi_k (``checkpoints/round-(k-1)``), and reports, for the calls whose rebuilt ids
differ and for the others: their share of calls and of trained tokens, the mean |log pi_k - log mu|
on the trained tokens, the share of tokens whose IS weight pi_k/mu exceeds C (truncated by TIS), and
the mean advantage (reward minus the round's mean). For every run (both replays) it also reports how
often the deployed policy wrote its tool calls compactly, per round: the behaviour a retokenized update
cannot see, since it trains on the server's re-serialisation instead.

    python scripts/replay_analysis.py runs/replay [--out docs/ablations/replay/analysis.json]
        [--plot docs/ablations/replay/plots/compact_call_share.png --plot-recipes recorded retokenized]
        [--from-json docs/ablations/replay/analysis.json]   (re-plot without recomputing)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

COMPACT = re.compile(r'<tool_call>\s*\{"name":"')
SPACED = re.compile(r'<tool_call>\s*\{"name": "')


def _recorded(home: Path) -> dict:
    rows = {}
    for p in sorted((home / "store" / "trajectories").rglob("*.parquet")):
        t = pq.read_table(p, columns=["trajectory_id", "call_index", "prompt_token_ids", "output_token_ids",
                                      "output_text"], partitioning=None)
        version = p.parent.name.split("=", 1)[1]  # hive-partitioned by policy_version
        for r in t.to_pylist():
            rows[(r["trajectory_id"], r["call_index"])] = {**r, "policy_version": version}
    return rows


@torch.no_grad()
def _logratios(model, table, vocab_size: int, bs: int = 64) -> dict[tuple[str, int], np.ndarray]:
    """log pi_k - log mu per trained token of every call, packed and scored as the trainer does
    (``rl.batch.pack_minibatch``, ``rl.logprobs.token_logprobs``)."""
    from prodrl_pipelines.rl.batch import pack_minibatch
    from prodrl_pipelines.rl.trajectory import trajectories_from_table
    from prodrl_pipelines.rl.logprobs import token_logprobs

    indices: dict[str, list[int]] = {}
    for tid, k in zip(table["trajectory_id"].to_pylist(), table["call_index"].to_pylist()):
        indices.setdefault(tid, []).append(k)
    trajs = trajectories_from_table(table)
    out = {}
    for s in range(0, len(trajs), bs):
        chunk = trajs[s:s + bs]
        batch = pack_minibatch(chunk, np.zeros(len(chunk)), pad_id=int(model.config.pad_token_id or 0),
                               vocab_size=vocab_size)
        delta = (token_logprobs(model, batch) - batch.logp_mu).numpy()
        rows = [(tr.trajectory_id, k) for tr in chunk for k, c in zip(sorted(indices[tr.trajectory_id]), tr.calls)
                if c.output_ids]
        gen_row = batch.gen_row.numpy()
        for row, key in enumerate(rows):
            out[key] = delta[gen_row == row]
    return out


def analyse_run(run_dir: Path, cap: float) -> dict:
    from transformers import AutoModelForCausalLM

    spec = json.loads((run_dir / "run.spec.json").read_text())
    home = run_dir / "home"
    rec = _recorded(home)
    by_version: dict[str, list[int]] = {}
    for r in rec.values():
        n_compact, n_spaced = len(COMPACT.findall(r["output_text"] or "")), len(SPACED.findall(r["output_text"] or ""))
        acc = by_version.setdefault(r["policy_version"], [0, 0])
        acc[0] += n_compact
        acc[1] += n_spaced
    compact_share = {v: c / max(c + s, 1) for v, (c, s) in sorted(by_version.items())}
    out = {"recipe": spec["recipe"], "seed": spec["seed"], "compact_call_share": compact_share, "rounds": []}
    if spec["settings"].get("replay") != "retokenized":
        return out
    torch.set_num_threads(1)
    for ds_path in sorted((home / "store" / "rounds").glob("round-*/dataset.parquet")):
        k = int(ds_path.parent.name.split("-")[1])
        table = pq.read_table(ds_path)
        ds = table.to_pylist()
        model = AutoModelForCausalLM.from_pretrained(home / "checkpoints" / f"round-{k - 1:06d}").eval()
        ratios = _logratios(model, table, int(model.config.vocab_size))
        # advantage as reward minus the round's mean trajectory reward (the leave-one-out baseline's limit)
        mean_r = float(np.mean(list({r["trajectory_id"]: r["reward"] for r in ds}.values())))
        groups = {True: [], False: []}
        for r in ds:
            key = (r["trajectory_id"], r["call_index"])
            orig = rec[key]
            differ = orig["prompt_token_ids"] != r["prompt_token_ids"] or orig["output_token_ids"] != r["output_token_ids"]
            d = ratios.get(key, np.zeros(0))
            groups[differ].append((d, r["reward"] - mean_r, d.size))
        row = {"round": k, "calls": len(ds)}
        n_tokens = sum(n for g in groups.values() for *_, n in g)
        for name, g in (("differ", groups[True]), ("same", groups[False])):
            d = np.concatenate([x for x, _, _ in g]) if g else np.zeros(0)
            row[name] = {
                "calls": len(g), "call_share": len(g) / len(ds), "token_share": float(d.size / max(n_tokens, 1)),
                "mean_abs_logratio": float(np.abs(d).mean()) if d.size else None,
                "truncated_share": float((d > np.log(cap)).mean()) if d.size else None,
                "mean_advantage": float(np.mean([a for _, a, _ in g])) if g else None,
            }
        out["rounds"].append(row)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ablation_dir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="PNG: share of compactly written calls per round, by recipe")
    ap.add_argument("--plot-recipes", nargs="+", help="recipes in the plot (default: all)")
    ap.add_argument("--from-json", type=Path, help="an earlier --out: plot it instead of analysing the runs")
    ap.add_argument("--cap", type=float, default=2.0, help="C of TIS (the recipe's tis_cap)")
    a = ap.parse_args(argv)
    runs = [] if a.from_json else sorted(p.parent for p in (a.ablation_dir / "runs").glob("*/seed*/result.json"))
    results = json.loads(a.from_json.read_text()) if a.from_json else []
    for r in runs:
        res = analyse_run(r, a.cap)
        results.append(res)
        last = res["rounds"][-1] if res["rounds"] else None
        shares = list(res["compact_call_share"].values())
        msg = f"{res['recipe']}/seed{res['seed']}: compact calls {shares[0]:.3f} -> {shares[-1]:.3f}"
        if res["rounds"]:
            dm = np.mean([x["differ"]["call_share"] for x in res["rounds"]])
            lr_d = np.mean([x["differ"]["mean_abs_logratio"] for x in res["rounds"] if x["differ"]["calls"]])
            lr_s = np.mean([x["same"]["mean_abs_logratio"] for x in res["rounds"] if x["same"]["calls"]])
            tr_d = np.mean([x["differ"]["truncated_share"] for x in res["rounds"] if x["differ"]["calls"]])
            msg += (f"; differing calls {dm:.3f} of calls, |log pi_k - log mu| {lr_d:.3f} on them vs {lr_s:.3f}, "
                    f"{tr_d:.3f} of their tokens truncated at C (last round: {last['differ']['calls']} calls)")
        print(msg, flush=True)
    if a.plot:
        from prodrl_pipelines.lab.ablation_plots import comparison_png

        curves: dict = {name: {} for name in a.plot_recipes or []}
        for res in results:
            if a.plot_recipes and res["recipe"] not in a.plot_recipes:
                continue
            curves.setdefault(res["recipe"], {})[res["seed"]] = list(res["compact_call_share"].values())
        a.plot.parent.mkdir(parents=True, exist_ok=True)
        a.plot.write_bytes(comparison_png(curves, "tool calls the deployed policy wrote compactly",
                                          ylabel="compact share of the policy's tool calls"))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
