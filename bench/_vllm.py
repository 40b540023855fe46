"""Shared by the vLLM benchmarks: the vLLM venv's interpreter and a small dense lab export."""

from __future__ import annotations

import sys
from pathlib import Path

SERVER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--enforce-eager")


def vllm_python_or_exit() -> str:
    from prodrl_pipelines.config import environment

    py = environment.vllm_python()
    if py is None or not Path(py).exists():
        print(f"skipped: no vLLM environment ({environment.DEFAULT_VLLM_VENV}: `make vllm` builds it)")
        sys.exit(0)
    return py


def dense_exports(root: Path, n: int = 2) -> list[Path]:
    """``n`` demo-size dense lab policies (other seeds, same architecture), exported bf16."""
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.quant.export import export_policy

    out = []
    for seed in range(n):
        ckpt = build_base_policy(root / f"ckpt{seed}", size="demo-dense", seed=seed, sft_steps=30, progress=False)
        out.append(root / f"policy{seed}")
        export_policy(ckpt, out[-1], "bf16")
    return out
