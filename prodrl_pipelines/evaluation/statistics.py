"""Normal-approximation confidence intervals of held-out rewards (the report and the gate)."""

from __future__ import annotations

import math

import numpy as np


def paired_confidence_interval(diffs: np.ndarray, z: float) -> tuple[float, float, float]:
    """mean(d) -/+ z * sd(d) / sqrt(n) over paired differences d (normal approximation)."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        raise ValueError("a paired interval needs at least 2 held-out tasks")
    m = float(d.mean())
    half = z * float(d.std(ddof=1)) / math.sqrt(d.size)
    return m, m - half, m + half


def mean_confidence_interval(x: np.ndarray, z: float = 1.96) -> tuple[float, float]:
    """(mean, half-width) of a normal-approximation interval."""
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()), float(z * x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")
