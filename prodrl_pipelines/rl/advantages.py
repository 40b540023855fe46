"""Advantages A_i = R_i - b_i (optionally / std(R)) with baselines chosen by name (DESIGN.md s.4).

Prod RL has one rollout per task and no task replay, so the default baseline is leave-one-out over
the round's dataset rather than a per-task group mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass
class BaselineState:
    """State carried across rounds (the `ema` baseline's running mean)."""

    ema: float | None = None


def loo_baseline(rewards: np.ndarray, task_ids: Sequence[str], state: BaselineState, decay: float) -> np.ndarray:
    """b_i = (sum_j R_j - R_i) / (n - 1): mean of the *other* trajectories of the round."""
    n = len(rewards)
    if n < 2:
        raise ValueError("loo baseline needs at least 2 trajectories")
    return (rewards.sum() - rewards) / (n - 1)


def batch_mean_baseline(rewards: np.ndarray, task_ids: Sequence[str], state: BaselineState, decay: float) -> np.ndarray:
    """b_i = (1/n) sum_j R_j (includes R_i itself: slightly biased, lower variance)."""
    return np.full_like(rewards, rewards.mean())


def ema_baseline(rewards: np.ndarray, task_ids: Sequence[str], state: BaselineState, decay: float) -> np.ndarray:
    """b_i = m_{k-1}, the running mean carried across rounds; then m_k = d*m_{k-1} + (1-d)*mean(R).

    The first round (no history) uses the round's mean. Mutates ``state``.
    """
    prev = float(rewards.mean()) if state.ema is None else state.ema
    state.ema = decay * prev + (1 - decay) * float(rewards.mean())
    return np.full_like(rewards, prev)


def task_group_baseline(rewards: np.ndarray, task_ids: Sequence[str], state: BaselineState, decay: float) -> np.ndarray:
    """b_i = mean of R_j over the other trajectories j != i with the same task id (0 if alone)."""
    ids = np.asarray(task_ids)
    out = np.zeros_like(rewards)
    for t in np.unique(ids):
        idx = np.flatnonzero(ids == t)
        if len(idx) > 1:
            out[idx] = (rewards[idx].sum() - rewards[idx]) / (len(idx) - 1)
    return out


BASELINES: dict[str, Callable[..., np.ndarray]] = {
    "loo": loo_baseline,
    "batch_mean": batch_mean_baseline,
    "ema": ema_baseline,
    "task_group": task_group_baseline,
}


def compute_advantages(
    rewards: Sequence[float],
    baseline: str = "loo",
    *,
    task_ids: Sequence[str] | None = None,
    state: BaselineState | None = None,
    normalize_std: bool = False,
    ema_decay: float = 0.9,
    eps: float = 1e-6,
) -> np.ndarray:
    """A_i = (R_i - b_i) [/ (std(R) + eps)]."""
    r = np.asarray(rewards, dtype=np.float64)
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite (non-finite rewards are quarantined upstream)")
    ids = list(task_ids) if task_ids is not None else [str(i) for i in range(len(r))]
    adv = r - BASELINES[baseline](r, ids, state if state is not None else BaselineState(), ema_decay)
    if normalize_std:
        adv = adv / (r.std() + eps)
    return adv
