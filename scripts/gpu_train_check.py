"""One prepared check of the trainer on a GPU machine: FSDP2 on one GPU with bf16, and log-probs.

Run it on a machine with a CUDA GPU (``python scripts/gpu_train_check.py``; about 2-4 minutes on an
H100/H200). It prints, as one table:

* FSDP2 training of a ~0.6B dense Qwen3 built from a config (no download): ``shard_policy`` over a
  1-rank NCCL mesh with the GPU mixed-precision policy (bf16 parameters, fp32 reduction and master
  weights), the trainer's ``policy_logprobs`` -> policy-gradient loss -> backward -> clip -> AdamW;
  tokens/s and MFU against the GPU's dense bf16 peak (``--peak-tflops``, default: looked up from the
  device name, else measured with a bf16 matmul);
* production-shaped training (``lab.agent_shapes`` "tool": a system prompt and up to 8 tool-using
  calls, 8k context, 16 trajectories): the trainer's own round (calls merged where their prompts
  extend, packed without padding, token-budget micro-batches) on the same 0.6B Qwen3 under FSDP2,
  flash-attention's variable-length path when ``flash_attn`` is installed, else SDPA with the
  block-diagonal mask; tokens computed / unique, unique tokens/s and MFU;
* chunked vs full log-probs at vocabulary 151,936 (time and peak CUDA memory of forward + backward,
  interleaved): the chunked path's memory ratio (target <= 0.25) and time ratio (target <= 1.3).

Without a GPU it says so and runs the same code on CPU at toy sizes (gloo, fp32), so the script
itself is checked everywhere; its figures then mean nothing. ``--json FILE`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# dense bf16 peak of common training GPUs, TFLOP/s (no sparsity)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(torch, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def bf16_peak(torch, name: str) -> tuple[float, str]:
    for key, tf in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tf * 1e12, f"{key} datasheet"
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, b)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b)
    torch.cuda.synchronize()
    return 2 * n**3 * 20 / (time.perf_counter() - t), "measured bf16 matmul"


def train_check(torch, cuda: bool, args) -> dict:
    import numpy as np
    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prodrl_pipelines.rl.trajectory import Call, Trajectory
    from prodrl_pipelines.rl.batch import pack_minibatch
    from prodrl_pipelines.rl.logprobs import policy_logprobs
    from prodrl_pipelines.rl.sharding import shard_policy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        cfg = Qwen3Config(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=4096)
        batch, seq = args.batch, args.seq
    else:
        cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True)
        batch, seq = 4, 32
    torch.manual_seed(0)
    device = "cuda" if cuda else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    root = shard_policy(model, 1)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-5)
    rng = np.random.default_rng(0)
    half = seq // 2
    trajs = [Trajectory(f"t{i}", "", "v0", 1.0, [Call(rng.integers(1, cfg.vocab_size, half).tolist(),
                                                      rng.integers(1, cfg.vocab_size, half).tolist(), [-1.0] * half,
                                                      1.0, [[1, 2]] * half, [[-1.0, -2.0]] * half)])
             for i in range(batch)]
    b = pack_minibatch(trajs, np.where(np.arange(batch) % 2, 0.5, -0.5), pad_id=0)
    for name in ("input_ids", "attention_mask", "gen_row", "gen_pos", "targets", "temperature", "adv", "weight",
                 "head_ids", "extra_ids"):
        setattr(b, name, getattr(b, name).to(device))

    def step() -> None:
        lp = policy_logprobs(root, b)
        loss = -(lp[:, 0] * b.adv * b.weight).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(root.parameters(), 1.0)
        opt.step()

    step()
    _sync(torch, cuda)
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(torch, cuda)
    dt = (time.perf_counter() - t) / args.steps
    tokens = batch * seq
    out = {"params": n_params, "tokens_per_step": tokens, "step_s": dt, "tokens_per_s": tokens / dt,
           "achieved_flops": 6 * n_params * tokens / dt}
    if cuda:
        peak, how = bf16_peak(torch, torch.cuda.get_device_name())
        out.update(peak_flops=peak, peak_source=how, mfu=out["achieved_flops"] / peak,
                   peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30)
    dist.destroy_process_group()
    return out


def shape_check(torch, cuda: bool, args) -> dict:
    """One round of one step on the tool-agent shape through ``train_round`` (pi_k + the step)."""
    import importlib.util

    import numpy as np
    import torch.distributed as dist
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prodrl_pipelines.lab.agent_shapes import shaped_minibatch
    from prodrl_pipelines.rl.checkpoint import TrainerState
    from prodrl_pipelines.rl.config import Recipe
    from prodrl_pipelines.rl.sharding import shard_policy
    from prodrl_pipelines.rl.trainer import build_optimizer, train_round

    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    attn = "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    if cuda:
        cfg = Qwen3Config(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=8192, attn_implementation=attn)
        batch, scale, budget, max_len = args.shape_batch, 1.0, 16384, 8192
    else:
        cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                          attn_implementation=attn)
        batch, scale, budget, max_len = 4, 0.05, 512, 512
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    root = shard_policy(model, 1)
    trajs = shaped_minibatch("tool", batch, cfg.vocab_size, seed=0, scale=scale, max_len=max_len)
    unique = sum(len(t.calls[-1].prompt_ids) + len(t.calls[-1].output_ids) for t in trajs)
    recipe = Recipe(steps_per_round=1, batch_size=batch, correction="tis", max_tokens_per_microbatch=budget,
                    learning_rate=1e-6)
    adv = np.where(np.arange(batch) % 2, 0.5, -0.5)
    times, res = [], None
    for _ in range(1 + args.steps):  # the first one warms up
        st = TrainerState()
        opt = build_optimizer(root, recipe, st)
        _sync(torch, cuda)
        t = time.perf_counter()
        res = train_round(root, opt, trajs, adv, [list(range(batch))], recipe, st, 0, 0, progress=False)
        _sync(torch, cuda)
        times.append(time.perf_counter() - t)
    dt = float(np.median(times[1:]))
    computed = res.steps[0]["input_tokens"]
    out = {"attn": attn, "trajectories": batch, "calls": sum(len(t.calls) for t in trajs), "unique_tokens": unique,
           "computed/unique": computed / unique, "micro_batches": res.steps[0]["micro_batches"],
           "round_s": dt, "unique_tokens_per_s": unique / dt,
           # pi_k forward (2 N T) + the step's forward and backward (6 N T) over the tokens computed
           "achieved_flops": 8 * n_params * computed / dt}
    if cuda:
        peak, _ = bf16_peak(torch, torch.cuda.get_device_name())
        out.update(mfu=out["achieved_flops"] / peak, peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30)
    dist.destroy_process_group()
    return out


def logprob_check(torch, cuda: bool) -> dict:
    from prodrl_pipelines.rl.logprobs import full_gather_logprobs, gather_logprobs

    device = "cuda" if cuda else "cpu"
    V, T, H, K = (151_936, 8192, 1024, 20) if cuda else (4096, 256, 64, 20)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    h0 = torch.randn(T, H, generator=g, device=device, dtype=dtype) * 0.05
    w0 = torch.randn(V, H, generator=g, device=device, dtype=dtype) * 0.05
    ids = torch.randint(0, V, (T, 1 + K), generator=g, device=device)
    tau = torch.ones(T, device=device)
    res = {"full": [], "chunked": []}
    for _ in range(3):
        for path in ("full", "chunked"):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t = time.perf_counter()
            out = gather_logprobs(h, w, ids, tau, 1024) if path == "chunked" else full_gather_logprobs(h, w, ids, tau)
            out.sum().backward()
            _sync(torch, cuda)
            res[path].append((time.perf_counter() - t, torch.cuda.max_memory_allocated() - base if cuda else 0))
    t_full = sorted(x[0] for x in res["full"])[1]
    t_chunk = sorted(x[0] for x in res["chunked"])[1]
    out = {"vocab": V, "tokens": T, "full_s": t_full, "chunked_s": t_chunk, "time_ratio": t_chunk / t_full}
    if cuda:
        out["memory_ratio"] = max(x[1] for x in res["chunked"]) / min(x[1] for x in res["full"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (GPU)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (GPU)")
    ap.add_argument("--shape-batch", type=int, default=16, help="tool-agent trajectories in the shape check (GPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        print(f"GPU: {torch.cuda.get_device_name()} (torch {torch.__version__})")
    else:
        print("no GPU here: running the same code on CPU at toy sizes (gloo, fp32); the figures mean nothing")
    train = train_check(torch, cuda, args)
    shape = shape_check(torch, cuda, args)
    lp = logprob_check(torch, cuda)
    print(f"FSDP2, 1 rank, {'bf16 params / fp32 reduce' if cuda else 'fp32'}: {train['params'] / 1e6:.0f}M params, "
          f"{train['tokens_per_step']} tokens/step, {train['step_s'] * 1e3:.0f} ms/step, {train['tokens_per_s']:.0f} tokens/s, "
          f"{train['achieved_flops'] / 1e12:.2f} TFLOP/s achieved")
    if cuda:
        print(f"  MFU {train['mfu']:.1%} of {train['peak_flops'] / 1e12:.0f} TFLOP/s ({train['peak_source']}); "
              f"peak memory {train['peak_memory_gib']:.1f} GiB")
    print(f"tool-agent shape ({shape['attn']}): {shape['trajectories']} trajectories, {shape['calls']} calls, "
          f"{shape['unique_tokens']} unique tokens, computed/unique {shape['computed/unique']:.3f}, "
          f"{shape['micro_batches']:.0f} micro-batches, {shape['round_s']:.2f} s a round of one step, "
          f"{shape['unique_tokens_per_s']:.0f} unique tokens/s"
          + (f", MFU {shape['mfu']:.1%}, peak memory {shape['peak_memory_gib']:.1f} GiB" if cuda else ""))
    print(f"log-probs, vocab {lp['vocab']}, {lp['tokens']} tokens: full {lp['full_s'] * 1e3:.0f} ms, chunked "
          f"{lp['chunked_s'] * 1e3:.0f} ms, time ratio {lp['time_ratio']:.2f} (target <= 1.3)"
          + (f", memory ratio {lp['memory_ratio']:.3f} (target <= 0.25)" if "memory_ratio" in lp else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"cuda": cuda, "train": train, "shape": shape, "logprobs": lp},
                                              indent=2))


if __name__ == "__main__":
    main()
