"""Normal-approximation confidence intervals of held-out rewards (the report and the gate)."""

from __future__ import annotations

import math
from collections import Counter

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


# an evaluation's per-task lists, in the order of its task_ids
PER_TASK = ("task_ids", "rewards", "facts")


class UnpairedEvaluations(ValueError):
    """Two evaluations to be paired ran different task sets; the message names the difference."""


def paired_on(ev: dict, task_ids: list) -> dict:
    """``ev`` with its per-task lists in the order of ``task_ids``: the gate and the monitors pair two
    evaluations index by index, and a harness may report its tasks in completion order. Raises
    ``UnpairedEvaluations`` when ``ev`` ran another task set."""
    own = list(ev["task_ids"])
    if own == list(task_ids):
        return ev
    # a suite may hold a task id more than once (the same task drawn twice): its k-th occurrence
    # pairs with the other's k-th
    pos: dict = {}
    for i, t in enumerate(own):
        pos.setdefault(t, []).append(i)
    if Counter(own) != Counter(task_ids):
        missing, extra = sorted(set(task_ids) - set(own)), sorted(set(own) - set(task_ids))
        raise UnpairedEvaluations(
            f"{ev.get('policy_version', 'an evaluation')} ran other tasks than the one it is paired with: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, extra {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''} ({len(own)} vs {len(task_ids)} tasks)")
    taken: Counter = Counter()
    idx = []
    for t in task_ids:
        idx.append(pos[t][taken[t]])
        taken[t] += 1
    return {**ev, **{k: [ev[k][i] for i in idx] for k in PER_TASK if k in ev and len(ev[k]) == len(idx)}}


def same_tasks(a: dict | None, task_ids: list) -> bool:
    """``a`` ran exactly ``task_ids`` (each as often), in any order."""
    return a is not None and Counter(a["task_ids"]) == Counter(task_ids)
