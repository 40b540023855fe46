"""Engine mismatch created by the export, on the lab model: mean |log pi_k - log mu| per generated
token, where mu is what the deployment recorded (LocalEngine serving the export) and pi_k is the fp32
trainer's log-probability of the same tokens (LocalEngine.score on the fp32 checkpoint). Side by side
in one run: the fp32 checkpoint served as is (only the KV-cache path differs), the bf16 export, the
NVFP4 W4A16 export and the NVFP4 W4A4 export (calibrated on 64 training-task prompts drawn with
another seed than the measured ones), served as the deployment serves it (activation quantization
simulated) and weights-only (what the trainer's reference model, load_policy, computes: the W4A16
numbers). Prints the W4A16 / bf16 and W4A4 / W4A16 ratios, the W4A4 deployment against its own
upcast weights (what reference-model IS cannot correct), and the generation slowdown of the
activation hooks (the same generate call with and without them, best of 3, single thread).

    python bench/export_mismatch.py [existing_base_checkpoint_dir] [--prompts 256] [--smoke]

Without an argument the demo-size lab base policy is built first (~30 s). Last line:
``export_mismatch: w4a16/bf16=X; w4a4/w4a16=X; w4a4 vs its weights=X; w4a4 generate slowdown=X``.

Smoke size (``--smoke``, bench/_smoke.py): the tiny lab policy (2 warm-start steps), 8 prompts, best of 1.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import add_policy_args, parse_args  # noqa: E402

from prodrl_pipelines.engines.local import LocalEngine  # noqa: E402
from prodrl_pipelines.engines.types import SamplingParams  # noqa: E402
from prodrl_pipelines.lab.arithmetic import generate_tasks, heldout_tasks, initial_messages  # noqa: E402
from prodrl_pipelines.lab.episodes import render_prompt, stop_token_ids  # noqa: E402
from prodrl_pipelines.quant.export import export_policy  # noqa: E402

N_PROMPTS, MAX_TOKENS, SEED = 256, 8, 0


def mismatch(served: LocalEngine, trainer: LocalEngine, prompts, params) -> dict:
    recs = served.generate(prompts, params, seed=SEED)
    outs = [r.output_token_ids for r in recs]
    pi = trainer.score(prompts, outs, params)
    d = [abs(a - b) for r, p in zip(recs, pi) for a, b in zip(r.output_logprobs, p)]
    return {"mean": statistics.fmean(d), "p99": sorted(d)[int(0.99 * (len(d) - 1))], "max": max(d), "tokens": len(d)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_policy_args(ap, "an existing base checkpoint (default: build the lab's)", N_PROMPTS)
    ap.add_argument("--repeats", type=int, default=3, help="generate calls timed (best of)")
    args = parse_args(ap, size="tiny", sft_steps=2, prompts=8, calibration=8, repeats=1)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="export_mismatch-"))
    if args.base:
        base = Path(args.base)
    else:
        from prodrl_pipelines.lab.warmstart import build_base_policy

        t0 = time.perf_counter()
        base = build_base_policy(tmp / "base", size=args.size, sft_steps=args.sft_steps, progress=False)
        print(f"built the {args.size} lab base policy in {time.perf_counter() - t0:.0f}s")
    exports = {"fp32 checkpoint (no export)": base}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    calib = [render_prompt(tok, initial_messages(t))[1] for t in generate_tasks(args.calibration, seed=7)]
    for scheme in ("bf16", "nvfp4-w4a16", "nvfp4-w4a4"):
        rep = export_policy(base, tmp / scheme, scheme, calibration_prompts=calib if scheme == "nvfp4-w4a4" else None)
        exports[scheme] = tmp / scheme
        print(f"{scheme:12s} export: {rep['export_bytes']} bytes, {rep['compression_ratio']:.2f}x vs bf16, "
              f"max rel. Frobenius error {rep['max_rel_fro_error']:.4f}")
    trainer = LocalEngine.from_pretrained(base)  # fp32 weights: pi_k
    tasks = generate_tasks(args.prompts // 2, seed=1) + heldout_tasks(args.prompts // 2)
    prompts = [render_prompt(tok, initial_messages(t))[1] for t in tasks]
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, num_top_logprobs=8,
                            stop_token_ids=stop_token_ids(tok))
    res = {}
    served = {name: LocalEngine.from_pretrained(path) for name, path in exports.items()}  # W4A4: activations simulated
    served["nvfp4-w4a4 weights-only"] = LocalEngine.from_pretrained(exports["nvfp4-w4a4"], simulate_activations=False)
    for name, engine in served.items():
        t0 = time.perf_counter()
        res[name] = mismatch(engine, trainer, prompts, params)
        r = res[name]
        r["seconds"] = time.perf_counter() - t0
        print(f"  served {name:28s} mean |log pi_k - log mu| = {r['mean']:.5f}  p99 {r['p99']:.4f}  "
              f"max {r['max']:.4f}  ({r['tokens']} tokens, generate+score {r['seconds']:.1f}s)")
    w4a16 = res["nvfp4-w4a16"]["mean"] / res["bf16"]["mean"]
    print(f"engine mismatch ratio W4A16 / bf16 = {w4a16:.1f}x (same prompts, same seed, same fp32 scorer)")
    w4a4 = res["nvfp4-w4a4"]["mean"] / res["nvfp4-w4a16"]["mean"]
    print(f"engine mismatch ratio W4A4 (activations simulated) / W4A16 = {w4a4:.2f}x")
    ref = mismatch(served["nvfp4-w4a4"], served["nvfp4-w4a4 weights-only"], prompts, params)
    print(f"  W4A4 deployment vs its upcast weights (the ref_is reference) mean |log pi_ref - log mu| = "
          f"{ref['mean']:.5f}  p99 {ref['p99']:.4f}  max {ref['max']:.4f}: the mismatch reference-model IS cannot see")
    # generation slowdown of the hooks: the same generate call, best of 3, hooks vs weights-only
    def gen_time(engine):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.generate(prompts, params, seed=SEED)
            best = min(best, time.perf_counter() - t0)
        return best
    t_sim, t_plain = gen_time(served["nvfp4-w4a4"]), gen_time(served["nvfp4-w4a4 weights-only"])
    print(f"W4A4 generate: {t_sim:.2f}s with activation quantization vs {t_plain:.2f}s weights-only "
          f"= {t_sim / t_plain:.2f}x slowdown ({len(prompts)} prompts x {MAX_TOKENS} tokens, best of {args.repeats})")
    print(f"export_mismatch: w4a16/bf16={w4a16:.1f}; w4a4/w4a16={w4a4:.2f}; w4a4 vs its weights={ref['mean']:.5f}; "
          f"w4a4 generate slowdown={t_sim / t_plain:.2f}")


if __name__ == "__main__":
    main()
