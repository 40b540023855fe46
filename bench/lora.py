"""LoRA against full fine-tuning, side by side in one run: redeploy time, trainer step time and peak
memory, export bytes, and (from an ablation's results) held-out reward after the same rounds.

- **redeploy**: seconds from "deploy" to "probe passed" of a round's adapter loaded into a running
  server (``vllm-lora``), against restarting the same server kind on the merged weights
  (``vllm-restart``, blue/green): the same lab policy, adapters and probe. Goal <= 0.1.
- **train step / peak memory**: one process per mode (alternating, ``--repeats`` each) trains a dense
  model of ``--hidden`` x ``--layers`` with the same recipe and batch, full (every weight, Adam over
  all) or LoRA (rank ``--rank`` on every linear layer, Adam over the adapters): the median step time,
  and the peak resident memory the process grew by from before the model was built (weights,
  gradients, optimizer state, activations). Memory goal <= 0.6.
- **export bytes**: the adapter (what an adapter target loads) against the whole export in
  ``--scheme`` (what the other targets load), for the same model.
- **held-out**: final held-out reward of ``--lora-recipe`` minus ``--full-recipe``, paired per seed,
  mean +- 95% CI, from an ablation's ``results.csv`` (``ablations/lora.yaml``; docs/ablations/lora).
  Goal: within the CI of full fine-tuning.

    python bench/lora.py [--server vllm|prodrl-serve] [--hidden 1024 --layers 6] [--ablation docs/ablations/lora/results.csv]

Last line: ``lora: redeploy adapter/restart=X; train step lora/full=X; trainer peak memory lora/full=X; export bytes lora/full=X; heldout lora-full=X±Y``

Smoke size (``--smoke``, bench/_smoke.py): ``prodrl serve`` for the redeploy, a one-layer 64-wide
model, one repeat of one step.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import parse_args  # noqa: E402

PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42, 9], [1, 12, 13], [1, 20, 21, 22, 23]]
REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=("vllm", "prodrl-serve"), default="vllm")
    ap.add_argument("--size", default="demo-dense", help="the served lab policy (dense: vLLM's CPU LoRA)")
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="timed train steps per process (after one warm-up)")
    ap.add_argument("--repeats", type=int, default=2, help="processes per mode (alternating)")
    ap.add_argument("--batch", type=int, default=8, help="trajectories of two calls per step")
    ap.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                    help="recompute each layer's activations in backward (recipe.activation_checkpointing), so "
                         "that weights, gradients and optimizer state dominate the memory, as at scale")
    ap.add_argument("--scheme", default="nvfp4-w4a16", help="the whole export's scheme")
    ap.add_argument("--ablation", default=str(REPO / "docs" / "ablations" / "lora" / "results.csv"))
    ap.add_argument("--lora-recipe", default="lora_r8")
    ap.add_argument("--full-recipe", default="full")
    ap.add_argument("--train-probe", choices=("full", "lora"), help=argparse.SUPPRESS)
    args = parse_args(ap, server="prodrl-serve", size="tiny-dense", sft_steps=5, hidden=64, layers=1, vocab=512,
                      steps=1, repeats=1, batch=2)
    if args.train_probe:
        print(json.dumps(train_probe(args)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        redeploy = redeploy_ratio(args, Path(tmp))
        train = train_ratios(args)
        size = bytes_ratio(args, Path(tmp))
    held = heldout_difference(Path(args.ablation), args.lora_recipe, args.full_recipe)
    print(f"lora: redeploy adapter/restart={redeploy:.3f}; train step lora/full={train['step']:.2f}; "
          f"trainer peak memory lora/full={train['memory']:.2f}; export bytes lora/full={size:.3f}; "
          f"heldout lora-full={held[0]:+.3f}±{held[1]:.3f}")


# ----------------------------------------------------------------------------- the model trained


def bench_model(args):
    from prodrl_pipelines.lab.model import build_model, lab_model_config

    heads = max(args.hidden // 64, 1)
    cfg = lab_model_config("demo-dense", vocab_size=args.vocab, pad_token_id=0, eos_token_id=1,
                           hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
                           num_key_value_heads=max(heads // 2, 1), head_dim=64, intermediate_size=3 * args.hidden)
    return build_model(cfg, seed=0).float()


def lora_recipe(args, training: str):
    from prodrl_pipelines.rl.config import Recipe

    return Recipe(training=training, lora_rank=args.rank, lora_alpha=2.0 * args.rank, steps_per_round=1,
                  batch_size=args.batch, learning_rate=1e-5)


def train_probe(args) -> dict:
    """In a process of its own: the step time and the peak memory one mode's training adds."""
    import numpy as np
    import torch

    from prodrl_pipelines.rl import lora
    from prodrl_pipelines.rl.batch import pack_minibatch
    from prodrl_pipelines.rl.checkpoint import TrainerState
    from prodrl_pipelines.rl.logprobs import policy_logprobs
    from prodrl_pipelines.rl.trainer import build_optimizer, train_step
    from prodrl_pipelines.rl.trajectory import Call, Trajectory

    torch.set_num_threads(1)
    warm = argparse.Namespace(**{**vars(args), "hidden": 64, "layers": 1, "vocab": 64})
    lora.with_adapter(bench_model(warm), lora_recipe(warm, "lora"))  # the libraries' lazy imports, not counted
    before = rss_mb("VmRSS")
    reset_peak()  # what the imports touched does not count
    recipe = lora_recipe(args, args.train_probe)
    model = bench_model(args)
    if args.train_probe == "lora":
        model = lora.with_adapter(model, recipe)
    if args.activation_checkpointing:
        from prodrl_pipelines.rl.sharding import checkpoint_activations

        checkpoint_activations(model)
    opt = build_optimizer(model, recipe, TrainerState())
    trained = lora.trainable_parameters(model)
    start = [p.detach().clone() for p in trained[:4]]
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(args.batch):
        calls = [Call(rng.integers(3, args.vocab, 48).tolist(), (outs := rng.integers(3, args.vocab, 16).tolist()),
                      [-1.0] * 16, 1.0, [[a] for a in outs], [[-1.0] for _ in outs], True, 1, 1.0) for _ in range(2)]
        trajs.append(Trajectory(f"t{i}", "x", "v", float(i % 2), calls))
    b = pack_minibatch(trajs, np.where(np.arange(args.batch) % 2, 0.5, -0.5), pad_id=0)
    with torch.no_grad():
        old = policy_logprobs(model, b)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        train_step(model, opt, [b], [old], None, recipe, recipe.correction_params())
        if step:  # the first is warm-up
            times.append(time.perf_counter() - t0)
    # the step trained: some of what trains moved (a LoRA's B starts at 0, its gradient through the
    # recomputed layers included)
    assert any(not torch.equal(a, p) for a, p in zip(start, trained[:4])), "nothing trained"
    return {"step_s": statistics.median(times), "grew_mb": rss_mb("VmHWM") - before,
            "trainable": sum(p.numel() for p in lora.trainable_parameters(model))}


def rss_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last ``reset_peak``) of this process, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """The peak resident size restarts from now (Linux: 5 > /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def train_ratios(args) -> dict:
    got = {"full": [], "lora": []}
    for rep in range(args.repeats):
        for mode in (("full", "lora") if rep % 2 == 0 else ("lora", "full")):
            cmd = [sys.executable, __file__, "--train-probe", mode, *[f"--{k}={getattr(args, k)}" for k in
                   ("hidden", "layers", "vocab", "rank", "steps", "batch")],
                   "--activation-checkpointing" if args.activation_checkpointing else "--no-activation-checkpointing"]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            got[mode].append(json.loads(out))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "grew_mb", "trainable")}
           for m, rs in got.items()}
    print(f"trainer, dense {args.layers} x {args.hidden} (vocab {args.vocab}), {args.batch} trajectories a step, "
          f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}, median of {args.repeats} "
          f"process(es) x {args.steps} step(s):")
    for m, r in med.items():
        print(f"  {m:5s} step {r['step_s'] * 1e3:8.1f} ms   peak memory +{r['grew_mb']:7.1f} MB   "
              f"{int(r['trainable']):,} trainable parameters")
    return {"step": med["lora"]["step_s"] / med["full"]["step_s"],
            "memory": med["lora"]["grew_mb"] / max(med["full"]["grew_mb"], 1e-9)}


# ----------------------------------------------------------------------------- bytes


def bytes_ratio(args, root: Path) -> float:
    from prodrl_pipelines.lab.tokenizer import build_tokenizer
    from prodrl_pipelines.quant.export import export_policy
    from prodrl_pipelines.rl import lora
    from prodrl_pipelines.rl.checkpoint import TrainerState, save_checkpoint

    model = bench_model(args)
    adapted = lora.with_adapter(model, lora_recipe(args, "lora"))
    lora.save_adapter(adapted, root / "adapter")
    save_checkpoint(root / "whole-checkpoint", lora.merged_copy(adapted), build_tokenizer(), None,
                    TrainerState())
    stats = export_policy(root / "whole-checkpoint", root / "whole-export", args.scheme)
    adapter = sum(f.stat().st_size for f in (root / "adapter").iterdir())
    print(f"export bytes: adapter (rank {args.rank}) {adapter / 1e6:.2f} MB, whole export ({args.scheme}) "
          f"{stats['export_bytes'] / 1e6:.2f} MB")
    return adapter / stats["export_bytes"]


# ----------------------------------------------------------------------------- redeploy


def redeploy_ratio(args, root: Path) -> float:
    from prodrl_pipelines.config.settings import Settings
    from prodrl_pipelines.deploy_targets import make_target
    from prodrl_pipelines.deploy_targets.processes import pick_port_range
    from prodrl_pipelines.deploy_targets.rollout import roll_out
    from prodrl_pipelines.lab.adapters import random_adapter_exports
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.quant.export import export_policy

    extra = {}
    if args.server == "vllm":
        from _vllm import SERVER_ARGS, vllm_python_or_exit

        extra = {"vllm_python": vllm_python_or_exit(), "server_args": SERVER_ARGS}
    ckpt = build_base_policy(root / "base-checkpoint", size=args.size, seed=0, sft_steps=args.sft_steps, progress=False)
    export_policy(ckpt, root / "base", "bf16")
    exports = random_adapter_exports(ckpt, root / "base", root / "exports", {"v1": 0.05, "v2": -0.05}, rank=8, alpha=16)
    seconds = {}
    for kind, target_name in (("adapter", f"{'vllm' if args.server == 'vllm' else 'prodrl-serve'}-lora"),
                              ("restart", "vllm-restart" if args.server == "vllm" else "prodrl-serve")):
        s = Settings(home=str(root / f"home-{kind}"), deploy={
            "target": target_name, "target_port": pick_port_range(4), "export_scheme": "bf16", "probe_prompts": 4,
            "max_tokens": 6, "lora_max_rank": 8, **extra})
        target = make_target(s)
        try:
            roll_out(s, target, exports["v1"], "v1", PROMPTS)
            ro = roll_out(s, target, exports["v2"], "v2", PROMPTS)  # the measured redeploy
            seconds[kind] = ro.seconds
            print(f"redeploy v1 -> v2 with {target_name}: {ro.seconds:.2f} s to probe passed "
                  f"({ro.switch.detail.get('mode', 'restart')}; probe mean |dlogp| {ro.probe.mean_abs:.4f})")
        finally:
            target.stop()
    return seconds["adapter"] / seconds["restart"]


# ----------------------------------------------------------------------------- held-out


def heldout_difference(results: Path, lora_recipe_name: str, full_recipe_name: str) -> tuple[float, float]:
    """Final held-out reward of the LoRA recipe minus full fine-tuning, paired by seed: mean, 95% CI
    half-width (t quantile); (nan, nan) without the ablation's results."""
    if not results.is_file():
        print(f"held-out: no ablation results at {results} (prodrl lab ablate --config ablations/lora.yaml)")
        return math.nan, math.nan
    final: dict[str, dict[str, tuple[int, float]]] = {}
    with open(results) as f:
        for row in csv.DictReader(f):
            if row.get("heldout_reward") in (None, "", "nan"):
                continue
            rnd, seed = int(row["round"]), row["seed"]
            best = final.setdefault(row["recipe"], {}).get(seed)
            if best is None or rnd > best[0]:
                final[row["recipe"]][seed] = (rnd, float(row["heldout_reward"]))
    lo, fu = final.get(lora_recipe_name, {}), final.get(full_recipe_name, {})
    diffs = [lo[s][1] - fu[s][1] for s in sorted(set(lo) & set(fu))]
    if not diffs:
        return math.nan, math.nan
    from scipy import stats

    mean = statistics.fmean(diffs)
    half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 \
        else math.nan
    print(f"held-out after round {max(r for r, _ in lo.values())}: {lora_recipe_name} - {full_recipe_name} per seed "
          f"{[round(d, 3) for d in diffs]}")
    return mean, half


if __name__ == "__main__":
    main()
