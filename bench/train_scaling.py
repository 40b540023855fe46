"""Training at world size 1 and 2 (FSDP2, gloo on CPU): throughput, memory per rank, achieved FLOP/s.

For each model -- the lab's default (a tiny Qwen3-MoE) and a ~110M-parameter dense Qwen3 built from a
config -- and each world size (1: one process, the in-process trainer's path; 2: ``torchrun``, the
policy sharded with ``rl.sharding.shard_policy``), a worker process trains ``--steps`` timed Adam
steps (after one warm-up step) on a synthetic minibatch of ``--batch`` sequences of ``--seq`` tokens
(prompt half, generated half), each rank packing its shard of it, exactly as the trainer does:
``policy_logprobs`` (chunked vocabulary projection) -> a policy-gradient loss -> backward -> clip ->
AdamW. Threads: the machine's cores split over the ranks.

Printed per model and world size: tokens/s (the minibatch's tokens per step time), peak RSS per
rank, parameter + Adam state bytes held per rank (the local shards: ~0.5x at 2 ranks is what
sharding buys), and the achieved FLOP/s (6 x parameters x tokens per step, the usual dense estimate)
against this machine's measured fp32 matmul peak (a 2048^3 ``torch.mm`` at the same thread count).
On 2 shared CPU cores throughput cannot scale (the two ranks split the same cores and add the
collectives); the memory column is the point here, and the GPU script (``scripts/gpu_train_check.py``)
measures MFU where it means something.

Last line: ``train_scaling: params+Adam/rank 2/1 lab=X [qwen3-110m=X]; tokens/s 2/1 lab=X [qwen3-110m=X]`` (the
models measured: ``--models``).

Usage: ``python bench/train_scaling.py [--steps 3] [--batch 8] [--seq 128] [--models lab qwen3-110m] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): the lab model only, one step of 2 x 16 tokens, a 256^3 matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from _smoke import parse_args  # noqa: E402

MODELS = ("lab", "qwen3-110m")


def build(name: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from prodrl_pipelines.lab.model import lab_model_config

    torch.manual_seed(0)
    if name == "lab":
        return Qwen3MoeForCausalLM(lab_model_config("demo", vocab_size=128))
    cfg = Qwen3Config(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12,
                      num_key_value_heads=4, head_dim=64, vocab_size=32768, tie_word_embeddings=True,
                      max_position_embeddings=1024)
    return Qwen3ForCausalLM(cfg)


def matmul_peak(threads: int, n: int = 2048, reps: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from prodrl_pipelines.rl.trajectory import Call, Trajectory
    from prodrl_pipelines.rl.batch import pack_minibatch
    from prodrl_pipelines.rl.logprobs import policy_logprobs

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    threads = max(1, (os.cpu_count() or 2) // world)
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo")
    model = build(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    trained = model
    if world > 1:
        from prodrl_pipelines.rl.sharding import shard_policy

        trained = shard_policy(model, world)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-5)
    rng = np.random.default_rng(0)
    half = args.seq // 2
    trajs = [Trajectory(f"t{i}", "", "v0", 1.0, [Call(rng.integers(1, vocab, half).tolist(),
                                                      rng.integers(1, vocab, half).tolist(), [-1.0] * half, 1.0,
                                                      [[1, 2]] * half, [[-1.0, -2.0]] * half)])
             for i in range(args.batch)]
    adv = np.where(np.arange(args.batch) % 2, 0.5, -0.5)
    mine = list(range(rank, args.batch, world))
    b = pack_minibatch([trajs[i] for i in mine], adv[mine], pad_id=0, total_batch=args.batch)

    def step() -> None:
        lp = policy_logprobs(trained, b)
        loss = -(lp[:, 0] * b.adv * b.weight).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained.parameters(), 1.0)
        opt.step()

    step()  # warm-up; creates the Adam state
    if world > 1:
        dist.barrier()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    if world > 1:
        dist.barrier()
    dt = (time.perf_counter() - t) / args.steps

    def local_bytes(x) -> int:
        x = x.to_local() if hasattr(x, "to_local") else x
        return x.numel() * x.element_size()

    held = sum(local_bytes(p) for p in trained.parameters())
    held += sum(local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    out = {"model": args.model, "world": world, "params": n_params, "tokens_per_step": args.batch * args.seq,
           "step_s": dt, "held_bytes": held, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    rows = [out]
    if world > 1:
        rows = [None] * world
        dist.all_gather_object(rows, out)
    if rank == 0:
        out = {**out, "held_bytes_per_rank": [r["held_bytes"] for r in rows], "peak_rss_per_rank": [r["peak_rss"] for r in rows],
               "matmul_peak": matmul_peak(threads, args.matmul_n), "threads_per_rank": threads}
        print("RESULT " + json.dumps(out), flush=True)
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: str, world: int, args) -> dict:
    me = [str(Path(__file__).resolve()), "--worker", "--model", model, "--steps", str(args.steps),
          "--batch", str(args.batch), "--seq", str(args.seq), "--matmul-n", str(args.matmul_n)]
    cmd = [sys.executable, *me] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world),
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *me]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{model} at world size {world} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="lab", choices=MODELS, help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="sequences per minibatch (split over the ranks)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (half prompt, half generated)")
    ap.add_argument("--matmul-n", type=int, default=2048, help="side of the matmul measuring the fp32 peak")
    args = parse_args(ap, models=["lab"], steps=1, batch=2, seq=16, matmul_n=256)
    if args.worker:
        worker(args)
        return
    print(f"FSDP2 training, CPU gloo, {os.cpu_count()} cores; {args.batch} x {args.seq} tokens per step, {args.steps} timed steps")
    print(f"{'model':12s} {'params':>8s} {'world':>5s} {'tokens/s':>9s} {'peak RSS/rank':>14s} {'params+Adam/rank':>17s} "
          f"{'vs 1 rank':>9s} {'GFLOP/s':>8s} {'fp32 mm peak':>12s} {'of peak':>7s}")
    held_ratio, speed_ratio = {}, {}
    for model in args.models:
        base = speed = None
        for world in (1, 2):
            r = run(model, world, args)
            held = max(r["held_bytes_per_rank"])
            base = base or held
            speed = speed or r["tokens_per_step"] / r["step_s"]
            held_ratio[model], speed_ratio[model] = held / base, r["tokens_per_step"] / r["step_s"] / speed
            flops = 6 * r["params"] * r["tokens_per_step"] / r["step_s"]
            peak = r["matmul_peak"] * r["world"]  # the ranks' threads together
            print(f"{model:12s} {r['params'] / 1e6:7.1f}M {world:5d} {r['tokens_per_step'] / r['step_s']:9.0f} "
                  f"{max(r['peak_rss_per_rank']) / 2**20:11.0f} MiB {held / 2**20:14.1f} MiB {held / base:9.2f} "
                  f"{flops / 1e9:8.1f} {peak / 1e9:9.1f} GF/s {flops / peak:7.1%}")
    print("train_scaling: params+Adam/rank 2/1 " + " ".join(f"{m}={x:.2f}" for m, x in held_ratio.items())
          + "; tokens/s 2/1 " + " ".join(f"{m}={x:.2f}" for m, x in speed_ratio.items()))


if __name__ == "__main__":
    main()
