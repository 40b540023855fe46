"""Shared by the vLLM benchmarks: the vLLM venv's interpreter and a small dense lab export."""

from __future__ import annotations

import sys
from pathlib import Path

SERVER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--enforce-eager")


def vllm_python_or_exit() -> str:
    """vLLM's interpreter; else a line that starts with "skipped:" and exit 0 (tests/test_benches.py
    reads it as a skip), also under ``PRODRL_SKIP_VLLM=1``, as `make vllm` then builds nothing."""
    import os

    from prodrl_pipelines.config import environment

    if os.environ.get("PRODRL_SKIP_VLLM") == "1":
        print("skipped: PRODRL_SKIP_VLLM=1")
        sys.exit(0)
    py = environment.vllm_python()
    if py is None or not Path(py).exists():
        print(f"skipped: no vLLM environment ({environment.DEFAULT_VLLM_VENV}: `make vllm` builds it)")
        sys.exit(0)
    return py


def dense_exports(root: Path, n: int = 2, size: str = "demo-dense", sft_steps: int = 30) -> list[Path]:
    """``n`` dense lab policies of ``size`` (other seeds, same architecture), exported bf16."""
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.quant.export import export_policy

    out = []
    for seed in range(n):
        ckpt = build_base_policy(root / f"ckpt{seed}", size=size, seed=seed, sft_steps=sft_steps, progress=False)
        out.append(root / f"policy{seed}")
        export_policy(ckpt, out[-1], "bf16")
    return out
