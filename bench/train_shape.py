"""Training on production-shaped traffic: tokens computed, peak memory and step time, new layout vs
the padded per-call layout, side by side in one run.

Shapes (``lab.agent_shapes``, lognormal lengths): ``chat`` (1 call), ``tool`` (up to 8 tool-using
calls), ``coding`` (up to 24 calls, long tool results), and ``tool-broken`` (the extension property
broken at every second call, as a template that drops earlier reasoning does).

1. Tokens, full size (16 trajectories a minibatch, no model needed): positions in the padded
   ``[calls x longest call]`` tensor, in one row per call without padding, and what the trainer's
   layout computes (merged sequences packed into micro-batches of 8,192), each over the unique
   tokens (every trajectory's tokens once: its last call's prompt + output).
2. Step time on the tool shape (lengths halved to fit a CPU; a small Qwen3 of 8k context): one
   round of one step (pi_k + the step) in the old layout (one padded tensor, one row per call) and
   the new (merged, packed, micro-batches of 4,096), interleaved.
3. Peak memory: a minibatch 4x larger at the same budget, each in a fresh process: the peak RSS the
   round adds above the model and Adam state (``phases.PhaseMeter``: the high-water mark reset first),
   with large allocations on mmap (what the trainer holds) and with glibc's default heap (which
   also keeps freed activation buffers of earlier micro-batches: fragmentation, not data).

Goals: tokens/unique <= 1.05 where the property holds (<= 1.05x the per-call sum where it breaks);
peak memory (4x)/(1x) <= 1.2; step time old/new on the tool shape >= 3.

Last line: ``train_shape: tokens/unique chat=X tool=X coding=X tool-broken/per-call=X; peak-memory(4x batch)/(1x)=X
(default malloc X); step-time old/new tool=X``.

Usage: ``python bench/train_shape.py [--batch 4] [--scale 0.5] [--reps 1] [--token-batch 16] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): minibatches of 2 trajectories (8 for the memory), lengths x0.05,
the memory with the mmap allocator only (``default malloc smoke``: two fresh processes fewer).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
from _smoke import parse_args

VOCAB = 8192
BUDGET_FULL = 8192
BUDGET_CPU = 4096


def model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                      pad_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).float()


def token_ratios(batch: int = 16) -> dict:
    from prodrl_pipelines.lab.agent_shapes import shaped_minibatch
    from prodrl_pipelines.rl.config import Recipe
    from prodrl_pipelines.rl.microbatches import pack_micro
    from prodrl_pipelines.rl.trainer import layout_round

    out = {}
    recipe = Recipe(steps_per_round=1, batch_size=batch, max_tokens_per_microbatch=BUDGET_FULL)
    for name, shape, brk in [("chat", "chat", 0), ("tool", "tool", 0), ("coding", "coding", 0),
                             ("tool-broken", "tool", 2)]:
        trajs = shaped_minibatch(shape, batch, VOCAB, seed=1, break_every=brk)
        unique = sum(len(t.calls[-1].prompt_ids) + len(t.calls[-1].output_ids) for t in trajs)
        rows = [len(c.prompt_ids) + len(c.output_ids) - 1 for t in trajs for c in t.calls]
        ((seqs, micro),), stats = layout_round(trajs, np.ones(batch), [list(range(batch))], recipe)
        computed = sum(pack_micro(seqs, m, 0, VOCAB).num_inputs for m in micro)  # row padding included
        out[name] = {"calls": len(rows), "longest": max(rows), "padded/unique": len(rows) * max(rows) / unique,
                     "per_call/unique": sum(rows) / unique, "new/unique": computed / unique,
                     "new/per_call": computed / sum(rows), "micro_batches": len(micro),
                     "merged": stats.merged_calls, "split": dict(stats.split_calls)}
    return out


def _one_round(layout: str, trajs, budget: int) -> float:
    import torch

    from prodrl_pipelines.rl.batch import pack_minibatch
    from prodrl_pipelines.rl.checkpoint import TrainerState
    from prodrl_pipelines.rl.config import Recipe
    from prodrl_pipelines.rl.logprobs import policy_logprobs
    from prodrl_pipelines.rl.trainer import build_optimizer, train_round, train_step

    B = len(trajs)
    adv = np.where(np.arange(B) % 2, 0.5, -0.5)
    recipe = Recipe(steps_per_round=1, batch_size=B, correction="tis", kl_beta=0.05, max_tokens_per_microbatch=budget)
    m = model()
    st = TrainerState()
    opt = build_optimizer(m, recipe, st)
    t0 = time.perf_counter()
    if layout == "old":  # one right-padded row per call, the whole minibatch in one tensor
        b = pack_minibatch(trajs, adv, pad_id=0)
        with torch.no_grad():
            old = policy_logprobs(m, b)
        train_step(m, opt, [b], [old], None, recipe, recipe.correction_params())
    else:
        train_round(m, opt, trajs, adv, [list(range(B))], recipe, st, 0, 0, progress=False)
    return time.perf_counter() - t0


def step_times(batch: int, scale: float, reps: int) -> dict:
    from prodrl_pipelines.lab.agent_shapes import shaped_minibatch

    trajs = shaped_minibatch("tool", batch, VOCAB, seed=2, scale=scale, max_len=8192)
    times = {"old": [], "new": []}
    for _ in range(reps):
        for layout in ("old", "new"):
            times[layout].append(_one_round(layout, trajs, BUDGET_CPU))
            print(f"  step time {layout}: {times[layout][-1]:.1f} s", flush=True)
    return {k: float(np.median(v)) for k, v in times.items()}


def memory_child(batch: int, scale: float) -> None:
    """One round on ``batch`` trajectories of the tool shape; prints the peak RSS it added."""
    import torch

    from prodrl_pipelines.lab.agent_shapes import shaped_minibatch
    from prodrl_pipelines.loop.phases import PhaseMeter
    from prodrl_pipelines.rl.checkpoint import TrainerState
    from prodrl_pipelines.rl.config import Recipe
    from prodrl_pipelines.rl.trainer import build_optimizer, train_round

    torch.set_num_threads(2)
    trajs = shaped_minibatch("tool", batch, VOCAB, seed=3, scale=scale, max_len=8192)
    warm = shaped_minibatch("chat", 2, VOCAB, seed=4, scale=0.05)
    recipe = Recipe(steps_per_round=1, batch_size=2, correction="tis", max_tokens_per_microbatch=BUDGET_CPU)
    m = model()
    st = TrainerState()
    opt = build_optimizer(m, recipe, st)
    train_round(m, opt, warm, np.array([0.5, -0.5]), [[0, 1]], recipe, st, 0, 0, progress=False)  # Adam state
    recipe = recipe.model_copy(update={"batch_size": batch})
    meter = PhaseMeter()  # resets the peak RSS: counts what the round adds
    with meter.phase("round"):
        train_round(m, opt, trajs, np.where(np.arange(batch) % 2, 0.5, -0.5), [list(range(batch))], recipe, st, 0, 0,
                    progress=False)
    print(json.dumps({"batch": batch, "added_peak_bytes": meter.phases["round"]["added_peak_mb"] * 1e6,
                      "tokens": sum(len(c.output_ids) + len(c.prompt_ids) for t in trajs for c in t.calls)}))


def peak_memory(batch: int, scale: float, allocators: tuple[str, ...] = ("mmap", "default")) -> dict:
    """Peak memory added by a round of ``batch`` and 4x ``batch`` trajectories, each in a fresh process:
    with glibc's large allocations on mmap (``MALLOC_MMAP_THRESHOLD_``: freed buffers go back to the
    system, so the figure is what the trainer holds) and with the default allocator (whose dynamic
    threshold keeps freed activation buffers in a fragmenting heap)."""
    import os

    out = {}
    for alloc, env in (("mmap", {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}), ("default", {})):
        if alloc not in allocators:
            continue
        for b in (batch, 4 * batch):
            r = subprocess.run([sys.executable, __file__, "--memory-child", str(b), "--scale", str(scale)],
                               capture_output=True, text=True, check=True, env={**os.environ, **env})
            out[alloc, b] = json.loads(r.stdout.strip().splitlines()[-1])["added_peak_bytes"]
            print(f"  peak memory added by a round of {b} trajectories ({alloc} allocator): "
                  f"{out[alloc, b] / 2**20:.0f} MiB", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--token-batch", type=int, default=16, help="trajectories a minibatch in the token count")
    ap.add_argument("--memory-child", type=int)
    args = parse_args(ap, batch=2, scale=0.05, token_batch=2)
    if args.memory_child:
        memory_child(args.memory_child, args.scale)
        return
    import torch

    torch.set_num_threads(2)
    print(f"tokens computed per unique token ({args.token_batch} trajectories a minibatch, full lengths):")
    ratios = token_ratios(args.token_batch)
    for name, r in ratios.items():
        print(f"  {name:12s} calls {r['calls']:4d} longest {r['longest']:6,d}  padded {r['padded/unique']:6.2f}  "
              f"per-call rows {r['per_call/unique']:5.2f}  new {r['new/unique']:5.3f} (x{r['new/per_call']:.3f} of "
              f"per-call)  micro-batches {r['micro_batches']}  merged {r['merged']} split {r['split']}")
    print(f"step time, tool shape, {args.batch} trajectories, lengths x{args.scale}:")
    t = step_times(args.batch, args.scale, args.reps)
    print(f"peak memory, tool shape, {args.batch} vs {4 * args.batch} trajectories, budget {BUDGET_CPU}:")
    mem = peak_memory(args.batch, args.scale, ("mmap",) if args.smoke else ("mmap", "default"))
    default = (f"{mem['default', 4 * args.batch] / mem['default', args.batch]:.2f}" if ("default", args.batch) in mem
               else "smoke")
    print(f"train_shape: tokens/unique chat={ratios['chat']['new/unique']:.3f} tool={ratios['tool']['new/unique']:.3f} "
          f"coding={ratios['coding']['new/unique']:.3f} tool-broken/per-call={ratios['tool-broken']['new/per_call']:.3f}; "
          f"peak-memory(4x batch)/(1x)={mem['mmap', 4 * args.batch] / mem['mmap', args.batch]:.2f} "
          f"(default malloc {default}); "
          f"step-time old/new tool={t['old'] / t['new']:.2f}")


if __name__ == "__main__":
    main()
