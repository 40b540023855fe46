"""When a recorded episode is complete, so that a scorer (grader, judge) may reward it: scoring an
episode still under way would grade its prefix and train on that grade with the whole episode.

A trajectory is complete when its client posted end-of-episode feedback (any reward row without a
scorer version: the feedback endpoint's rows, whatever label the client gave, e.g. ``source: done``)
or when its last call is ``rewards_idle_seconds`` old. A scorer's row is stale when it is older than
the trajectory's last call (the client went on after an idle pause): the episode is scored again,
and the newest row wins. Rows a scorer writes are stamped no earlier than the last call it saw, so a
recorder's clock ahead of the scorer's never makes a fresh grade look stale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc


@dataclass
class Completion:
    complete: set[str]
    in_flight: set[str]
    last_call_us: dict[str, int]  # epoch microseconds of each trajectory's newest call


def completion(calls: pa.Table, rewards: pa.Table, idle_seconds: float, now_us: int | None = None) -> Completion:
    """Which trajectories of ``calls`` (with ``created_at``) are complete at ``now_us`` (default:
    now), given their stored reward rows (REWARD_SCHEMA, every row)."""
    now_us = time.time_ns() // 1000 if now_us is None else now_us
    last: dict[str, int] = {}
    ts = _us(calls.column("created_at"))
    for tid, t in zip(calls.column("trajectory_id").to_pylist(), ts):
        if t is not None and t > last.get(tid, -1):
            last[tid] = t
        last.setdefault(tid, -1)
    told = set(rewards.filter(pc.is_null(rewards.column("version"))).column("trajectory_id").to_pylist()) \
        if rewards.num_rows else set()
    idle_us = int(idle_seconds * 1_000_000)
    complete = {t for t, at in last.items() if t in told or now_us - at >= idle_us}
    return Completion(complete, set(last) - complete, last)


def fresh_rows(rows: pa.Table, last_call_us: dict[str, int]) -> set[str]:
    """Trajectories with a row in ``rows`` (one scorer's, at one version) no older than their last call."""
    ts = _us(rows.column("created_at"))
    return {t for t, r, at in zip(rows.column("trajectory_id").to_pylist(), rows.column("reward").to_pylist(), ts)
            if r is not None and at is not None and at >= last_call_us.get(t, -1)}


def _us(column) -> list[int | None]:
    return pc.cast(pc.cast(column, pa.timestamp("us", tz="UTC")), pa.int64()).to_pylist()
