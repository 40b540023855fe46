"""Replaying a previous process's write-ahead log: which of its entries the store already holds (a
crash between a commit and deleting its segment) and which are still to be written, with the
(trajectory, call index) pairs taken, from which the next call indices follow."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa

from prodrl_pipelines.recorder.skips import load_skips
from prodrl_pipelines.recorder.wal import WriteAheadLog, seq_of
from prodrl_pipelines.trajectories.schema import call_id
from prodrl_pipelines.trajectories.store import CALLS as CALLS_T
from prodrl_pipelines.trajectories.store import REWARDS as REWARDS_T


def retraction_of(entry: dict) -> dict | None:
    """The store retraction a WAL entry carries (a retry superseding its earlier row), or None."""
    if entry.get("supersedes") is None:
        return None
    at = entry["row"] if entry["kind"] == "call" else entry
    return {"trajectory_id": at["trajectory_id"], "call_index": int(at["call_index"]),
            "created_at": int(entry["supersedes"])}


def reward_key(tid: str, source: Any, created_us: int, reward: float) -> tuple:
    return (tid, source, int(created_us), float(reward))


@dataclass
class ReplayPlan:
    calls: list[dict] = field(default_factory=list)
    rewards: list[dict] = field(default_factory=list)
    skips: list[dict] = field(default_factory=list)
    retractions: list[dict] = field(default_factory=list)
    seen: list[tuple[str, int]] = field(default_factory=list)  # (trajectory, call index) already taken
    segments: list = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)


def replay_plan(store, wal: WriteAheadLog, committed: Callable[[int], dict[str, bool]]) -> ReplayPlan:
    """What replaying ``wal``'s segments into ``store`` writes; ``committed(seq)``: whether a
    segment's commit landed, per table (its application transaction)."""
    counts = Counter()
    stored_calls: set[tuple[str, int]] = set()  # (call id, created_at): a retry is another row of its call id
    calls = store.read_calls(columns=["trajectory_id", "call_index", "created_at"], dedupe=False, retracted=True)
    seen: list[tuple[str, int]] = []  # (trajectory, call index) already taken: the next index is past them
    for tid, ci, c in zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist(),
                          calls.column("created_at").cast(pa.int64()).to_pylist()):
        stored_calls.add((call_id(tid, ci), c))
        seen.append((tid, int(ci)))
    rewards = store.read_rewards(latest=False)
    stored_rewards = set()
    if rewards.num_rows:
        created = rewards.column("created_at").cast(pa.int64()).to_pylist()
        for tid, r, src, c in zip(rewards.column("trajectory_id").to_pylist(), rewards.column("reward").to_pylist(),
                                  rewards.column("source").to_pylist(), created):
            if r is not None and c is not None:
                stored_rewards.add(reward_key(tid, src, c, r))
    stored_skips: set[str] = set()
    for s in load_skips(store.blobs):  # one folded part, plus those flushed since
        stored_skips.add(call_id(s["trajectory_id"], s["call_index"]))
        seen.append((s["trajectory_id"], int(s["call_index"])))

    new_calls, new_rewards, new_skips, new_retractions = [], [], [], []
    segments = wal.segments()
    for path in segments:
        seg = wal.read_segment(path)
        if seg.torn:
            counts["wal_torn_tails"] += 1
        # a segment whose commit landed (its application transaction) is not written again
        done = committed(seq_of(path))
        for e in seg.entries:
            kind = e.get("kind")
            if kind == "call":
                row = e["row"]
                cid = (call_id(row["trajectory_id"], row["call_index"]), row.get("created_at"))
                if done[CALLS_T]:
                    counts["replay_committed"] += 1
                    stored_calls.add(cid)
                    seen.append((row["trajectory_id"], int(row["call_index"])))
                    continue
                if cid in stored_calls:
                    counts["replay_duplicates"] += 1
                    continue
                stored_calls.add(cid)
                new_calls.append(row)
                if (r := retraction_of(e)) is not None:
                    new_retractions.append(r)
                seen.append((row["trajectory_id"], int(row["call_index"])))
            elif kind == "skip":
                cid = call_id(e["trajectory_id"], e["call_index"])
                if (r := retraction_of(e)) is not None:  # idempotent: written again whether or not it was
                    new_retractions.append(r)
                if cid in stored_skips:
                    counts["replay_duplicates"] += 1
                    continue
                stored_skips.add(cid)
                new_skips.append(e)
                seen.append((e["trajectory_id"], int(e["call_index"])))
            elif kind == "reward":
                row = e["row"]
                k = reward_key(row["trajectory_id"], row["source"], row["created_at"], row["reward"])
                if done[REWARDS_T]:
                    counts["replay_committed"] += 1
                    continue
                if k in stored_rewards:
                    counts["replay_duplicates"] += 1
                    continue
                stored_rewards.add(k)
                new_rewards.append(row)
    return ReplayPlan(new_calls, new_rewards, new_skips, new_retractions, seen, segments, counts)
