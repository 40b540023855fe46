"""The deployment gate: a paired non-inferiority test on the same held-out tasks, plus sanity.

Pass iff every weight is finite, the export loaded and generated, and the lower confidence
bound of mean(candidate - live) over the paired held-out tasks is >= -tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class GateDecision:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    mean_diff: float = float("nan")
    diff_lower: float = float("nan")
    diff_upper: float = float("nan")
    candidate_mean: float = float("nan")
    live_mean: float = float("nan")
    n_tasks: int = 0
    tolerance: float = float("nan")

    def summary(self) -> str:
        numbers = (f"mean paired difference {self.mean_diff:+.4f} over {self.n_tasks} tasks, lower bound "
                   f"{self.diff_lower:+.4f} vs -tolerance {-self.tolerance:.4f} (candidate {self.candidate_mean:.4f}, "
                   f"live {self.live_mean:.4f})")
        return f"passed: {numbers}" if self.passed else "failed: " + "; ".join(self.reasons) + f" [{numbers}]"


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


def count_nonfinite(state_dict: dict[str, torch.Tensor]) -> dict[str, int]:
    """Tensor name -> number of NaN/Inf entries, only for tensors that have any."""
    bad = {}
    for name, t in state_dict.items():
        if t.is_floating_point():
            n = int((~torch.isfinite(t)).sum())
            if n:
                bad[name] = n
    return bad


def decide(
    candidate_rewards: np.ndarray,
    live_rewards: np.ndarray,
    *,
    tolerance: float,
    z: float,
    nonfinite: dict[str, int],
    smoke_ok: bool,
    smoke_error: str = "",
) -> GateDecision:
    cand = np.asarray(candidate_rewards, dtype=np.float64)
    live = np.asarray(live_rewards, dtype=np.float64)
    if cand.shape != live.shape:
        raise ValueError(f"paired gate needs the same tasks: {cand.shape} vs {live.shape} rewards")
    reasons = []
    if nonfinite:
        names = ", ".join(f"{k} ({v})" for k, v in list(nonfinite.items())[:5])
        reasons.append(f"non-finite weights in {len(nonfinite)} tensors: {names}")
    if not smoke_ok:
        reasons.append(f"export failed to load/generate: {smoke_error}")
    m, lo, hi = (float("nan"),) * 3
    if cand.size >= 2 and np.all(np.isfinite(cand)):
        m, lo, hi = paired_confidence_interval(cand - live, z)
        if lo < -tolerance:
            reasons.append(
                f"held-out reward regression: mean(candidate - live) = {m:+.4f}, lower bound {lo:+.4f} "
                f"< -tolerance {-tolerance:.4f}"
            )
    else:
        reasons.append("held-out evaluation produced no usable rewards")
    return GateDecision(
        passed=not reasons, reasons=reasons, mean_diff=m, diff_lower=lo, diff_upper=hi,
        candidate_mean=float(cand.mean()) if cand.size else float("nan"),
        live_mean=float(live.mean()) if live.size else float("nan"), n_tasks=int(cand.size), tolerance=float(tolerance),
    )
