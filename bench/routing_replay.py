"""Routing replay (R3) on the lab MoE: how often the deployment's experts differ from the trainer's
own routing, and |log pi_k - log mu| per generated token with and without replaying the recorded
routing, side by side on the same data.

The deployment is the local engine serving each export (bf16, NVFP4 W4A16, NVFP4 W4A4 with its
activation quantization simulated) and recording its experts; pi_k is the fp32 trainer (the base
checkpoint) on exactly the recorded tokens, packed as the trainer packs them, once with its own
routing and once with the recorded one. Mean and p99 over all generated tokens.

    python bench/routing_replay.py [existing_base_checkpoint_dir] [--prompts 256] [--smoke]

Ends with ``routing_replay: engine=local-nvfp4-w4a4; disagreement=...; mean_off=...; mean_on=...;
p99_off=...; p99_on=...; p99_ratio=...`` (p99 without replay / with).

Smoke size (``--smoke``, bench/_smoke.py): the tiny lab MoE (2 warm-start steps), 8 prompts.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import add_policy_args, parse_args  # noqa: E402

from prodrl_pipelines.engines.local import LocalEngine  # noqa: E402
from prodrl_pipelines.engines.types import SamplingParams  # noqa: E402
from prodrl_pipelines.lab.arithmetic import generate_tasks, heldout_tasks, initial_messages  # noqa: E402
from prodrl_pipelines.lab.episodes import render_prompt, stop_token_ids  # noqa: E402
from prodrl_pipelines.quant.export import export_policy  # noqa: E402
from prodrl_pipelines.rl.batch import pack_sequences  # noqa: E402
from prodrl_pipelines.rl.logprobs import policy_logprobs  # noqa: E402
from prodrl_pipelines.rl.routing_replay import RoutingStats  # noqa: E402
from prodrl_pipelines.rl.sequences import minibatch_sequences  # noqa: E402
from prodrl_pipelines.rl.trajectory import Call, Trajectory  # noqa: E402

N_PROMPTS, MAX_TOKENS, SEED = 256, 8, 0


def measure(served: LocalEngine, trainer, prompts, params) -> dict:
    recs = served.generate(prompts, params, seed=SEED)
    trajs = [Trajectory(f"t{i}", "", "v", 0.0, [Call(r.prompt_token_ids, r.output_token_ids, r.output_logprobs,
                                                     params.temperature, routing=r.routed_experts)])
             for i, r in enumerate(recs) if r.output_token_ids]
    seqs = minibatch_sequences(trajs, np.zeros(len(trajs)))
    b = pack_sequences(seqs, pad_id=0, with_routing=True)
    stats = RoutingStats()
    with torch.no_grad():
        on = policy_logprobs(trainer, b, replay=True, routing_stats=stats)[:, 0]
        off = policy_logprobs(trainer, b, replay=False)[:, 0]
    d_on, d_off = (on - b.logp_mu).abs().double().numpy(), (off - b.logp_mu).abs().double().numpy()
    return {"disagreement": stats.disagreement, "per_layer": stats.per_layer(), "tokens": len(d_on),
            "mean_off": d_off.mean(), "mean_on": d_on.mean(),
            "p99_off": float(np.quantile(d_off, 0.99)), "p99_on": float(np.quantile(d_on, 0.99)),
            "max_off": d_off.max(), "max_on": d_on.max()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_policy_args(ap, "an existing base checkpoint, a MoE (default: build the lab's)", N_PROMPTS)
    args = parse_args(ap, size="tiny", sft_steps=2, prompts=8, calibration=8)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="routing_replay-"))
    if args.base:
        base = Path(args.base)
    else:
        from prodrl_pipelines.lab.warmstart import build_base_policy

        t0 = time.perf_counter()
        base = build_base_policy(tmp / "base", size=args.size, sft_steps=args.sft_steps, progress=False)
        print(f"built the {args.size} lab base policy (MoE) in {time.perf_counter() - t0:.0f}s")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    calib = [render_prompt(tok, initial_messages(t))[1] for t in generate_tasks(args.calibration, seed=7)]
    exports = {"fp32 checkpoint": base}
    for scheme in ("bf16", "nvfp4-w4a16", "nvfp4-w4a4"):
        export_policy(base, tmp / scheme, scheme, calibration_prompts=calib if scheme == "nvfp4-w4a4" else None)
        exports[scheme] = tmp / scheme
    trainer = LocalEngine.from_pretrained(base).model  # fp32: pi_k
    tasks = generate_tasks(args.prompts // 2, seed=1) + heldout_tasks(args.prompts // 2)
    prompts = [render_prompt(tok, initial_messages(t))[1] for t in tasks]
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, num_top_logprobs=8,
                            stop_token_ids=stop_token_ids(tok), record_routing=True)
    print(f"{'deployment (local engine)':26s} {'tokens':>6s} {'routing differs':>15s} "
          f"{'mean off':>9s} {'mean on':>9s} {'p99 off':>9s} {'p99 on':>9s} {'max off':>8s} {'max on':>8s}")
    res = {}
    for name, path in exports.items():
        r = res[name] = measure(LocalEngine.from_pretrained(path), trainer, prompts, params)
        print(f"{name:26s} {r['tokens']:6d} {r['disagreement']:15.2%} {r['mean_off']:9.5f} {r['mean_on']:9.5f} "
              f"{r['p99_off']:9.4f} {r['p99_on']:9.4f} {r['max_off']:8.3f} {r['max_on']:8.3f}")
        print(f"{'':26s} per layer: " + ", ".join(f"{x:.2%}" for x in r["per_layer"]))
    w = res["nvfp4-w4a4"]
    print(f"routing_replay: engine=local-nvfp4-w4a4; disagreement={w['disagreement']:.4f}; "
          f"mean_off={w['mean_off']:.5f}; mean_on={w['mean_on']:.5f}; p99_off={w['p99_off']:.4f}; "
          f"p99_on={w['p99_on']:.4f}; p99_ratio={w['p99_off'] / w['p99_on']:.2f}")


if __name__ == "__main__":
    main()
