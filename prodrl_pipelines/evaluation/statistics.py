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


# an evaluation's per-task lists, in the order of its task_ids
PER_TASK = ("task_ids", "rewards", "facts")


class UnpairedEvaluations(ValueError):
    """Two evaluations to be paired ran different task sets; the message names the difference."""


def paired_on(ev: dict, task_ids: list) -> dict:
    """``ev`` with its per-task lists in the order of ``task_ids``: the gate and the monitors pair two
    evaluations index by index, and a harness may report its tasks in completion order. Raises
    ``UnpairedEvaluations`` when ``ev`` ran another task set."""
    pos = {t: i for i, t in enumerate(ev["task_ids"])}
    if set(pos) != set(task_ids) or len(task_ids) != len(ev["task_ids"]):
        missing, extra = sorted(set(task_ids) - set(pos)), sorted(set(pos) - set(task_ids))
        raise UnpairedEvaluations(
            f"{ev.get('policy_version', 'an evaluation')} ran other tasks than the one it is paired with: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, extra {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''} ({len(ev['task_ids'])} vs {len(task_ids)} tasks)")
    idx = [pos[t] for t in task_ids]
    return {**ev, **{k: [ev[k][i] for i in idx] for k in PER_TASK if k in ev and len(ev[k]) == len(idx)}}


def same_tasks(a: dict | None, task_ids: list) -> bool:
    """``a`` ran exactly ``task_ids``, in any order."""
    return a is not None and len(a["task_ids"]) == len(task_ids) and set(a["task_ids"]) == set(task_ids)
