"""Engine mismatch created by the export, on the lab model: mean |log pi_k - log mu| per generated
token, where mu is what the deployment recorded (LocalEngine serving the export) and pi_k is the fp32
trainer's log-probability of the same tokens (LocalEngine.score on the fp32 checkpoint). Side by side
in one run: the fp32 checkpoint served as is (only the KV-cache path differs), the bf16 export and
the NVFP4 W4A16 export; prints the W4A16 / bf16 ratio.

    python bench/export_mismatch.py [existing_base_checkpoint_dir]

Without an argument the demo-size lab base policy is built first (~30 s).
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.lab.arithmetic import generate_tasks, heldout_tasks, initial_messages
from prodrl_pipelines.lab.episodes import render_prompt, stop_token_ids
from prodrl_pipelines.quant.export import export_policy

N_PROMPTS, MAX_TOKENS, SEED = 256, 8, 0


def mismatch(served: LocalEngine, trainer: LocalEngine, prompts, params) -> dict:
    recs = served.generate(prompts, params, seed=SEED)
    outs = [r.output_token_ids for r in recs]
    pi = trainer.score(prompts, outs, params)
    d = [abs(a - b) for r, p in zip(recs, pi) for a, b in zip(r.output_logprobs, p)]
    return {"mean": statistics.fmean(d), "p99": sorted(d)[int(0.99 * (len(d) - 1))], "max": max(d), "tokens": len(d)}


def main() -> None:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="export_mismatch-"))
    if len(sys.argv) > 1:
        base = Path(sys.argv[1])
    else:
        from prodrl_pipelines.lab.warmstart import build_base_policy

        t0 = time.perf_counter()
        base = build_base_policy(tmp / "base", size="demo", progress=False)
        print(f"built the demo lab base policy in {time.perf_counter() - t0:.0f}s")
    exports = {"fp32 checkpoint (no export)": base}
    for scheme in ("bf16", "nvfp4-w4a16"):
        rep = export_policy(base, tmp / scheme, scheme)
        exports[scheme] = tmp / scheme
        print(f"{scheme:12s} export: {rep['export_bytes']} bytes, {rep['compression_ratio']:.2f}x vs bf16, "
              f"max rel. Frobenius error {rep['max_rel_fro_error']:.4f}")
    trainer = LocalEngine.from_pretrained(base)  # fp32 weights: pi_k
    tok = trainer.tokenizer
    tasks = generate_tasks(N_PROMPTS // 2, seed=1) + heldout_tasks(N_PROMPTS // 2)
    prompts = [render_prompt(tok, initial_messages(t))[1] for t in tasks]
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, num_top_logprobs=8,
                            stop_token_ids=stop_token_ids(tok))
    res = {}
    for name, path in exports.items():
        res[name] = mismatch(LocalEngine.from_pretrained(path), trainer, prompts, params)
        r = res[name]
        print(f"  served {name:28s} mean |log pi_k - log mu| = {r['mean']:.5f}  p99 {r['p99']:.4f}  "
              f"max {r['max']:.4f}  ({r['tokens']} tokens)")
    ratio = res["nvfp4-w4a16"]["mean"] / res["bf16"]["mean"]
    print(f"engine mismatch ratio W4A16 / bf16 = {ratio:.1f}x (same prompts, same seed, same fp32 scorer)")


if __name__ == "__main__":
    main()
