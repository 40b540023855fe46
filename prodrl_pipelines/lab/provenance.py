"""What ran, at which commit, on which machine: stated beside every docs table made from a lab
command's JSON (``scripts/docs_numbers.py``)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def provenance(argv: list[str]) -> dict:
    """What ran, at which commit, on which machine: stated beside every table made from the output."""
    import torch

    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                cwd=repo, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "prodrl_pipelines"],
                               capture_output=True, text=True, cwd=repo, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return {"command": " ".join(["prodrl", *argv]), "commit": (commit + ("+dirty" if dirty else "")) or "unknown",
            # the kernels torch dispatches to (AVX2, AVX512, ...) change float rounding, so the results
            "machine": f"{_cpu_model()}, {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
                       f"({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}), "
                       f"Python {platform.python_version()}"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
