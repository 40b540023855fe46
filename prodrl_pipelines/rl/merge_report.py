"""Where multi-turn merging holds and where it breaks, per policy version (``prodrl data merges``).

The trainer lays each trajectory's calls out as training sequences (``rl.sequences``): a call whose
prompt extends the previous call's prompt + output ids joins its sequence; a call that does not
starts a new one, counted by reason (``SPLIT_REASONS``: ``output_rewritten`` when the template or the
harness re-rendered the model's own output, ``history_edited`` when the history itself changed). This
report runs that same layout (``trajectory_sequences``, nothing re-implemented) over the stored calls,
so an operator sees before any round whether an agent's episodes train as one sequence each or as one
per call, and which rule breaks them.

Per policy version (a trajectory counts under the version of its first call; ``crossed_versions``
says how many also have calls under another version, laid out whole all the same):

* ``trajectories``; ``multi_call``: those with two calls or more that are laid out;
* ``merged_whole``: multi-call trajectories that give one training sequence (``merged_frac``);
* ``sequences``: the training sequences the multi-call trajectories give;
* ``split_<reason>``: calls that started a new sequence, by reason;
* ``incomplete``: trajectories not laid out: a call index missing (a call the recorder skipped, a
  retraction without its retry) or no generated token at all;
* ``tokens_saved_frac``: 1 - merged positions / per-call positions of the multi-call trajectories.

Rows are read as the trainer reads them (``read_calls``: de-duplicated, retractions applied), at one
pinned snapshot of the tables: first the key columns of every call, then the token ids of the
multi-call trajectories, ``chunk`` of them at a time, from the partitions they touch only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import pyarrow as pa

from prodrl_pipelines.rl.sequences import SPLIT_REASONS, LayoutStats, trajectory_sequences
from prodrl_pipelines.rl.trajectory import Call, Trajectory
from prodrl_pipelines.trajectories.store import TrajectoryStore

__all__ = ["VersionMerges", "merge_report", "merge_rows"]


@dataclass
class VersionMerges:
    """The merge counts of one policy version (see the module docstring)."""

    policy_version: str
    trajectories: int = 0
    multi_call: int = 0
    merged_whole: int = 0
    sequences: int = 0
    incomplete: int = 0
    crossed_versions: int = 0
    layout: LayoutStats = field(default_factory=LayoutStats)

    def add(self, traj: Trajectory) -> None:
        """Lay out one complete multi-call trajectory as the trainer does and count what it gives."""
        if traj.num_generated == 0:
            self.incomplete += 1
            return
        seqs = trajectory_sequences(traj, 0.0, 1, 0, merge=True, stats=self.layout)
        self.multi_call += 1
        self.sequences += len(seqs)
        self.merged_whole += len(seqs) == 1

    def as_row(self) -> dict:
        lay = self.layout
        return {
            "policy_version": self.policy_version, "trajectories": self.trajectories, "multi_call": self.multi_call,
            "merged_whole": self.merged_whole,
            "merged_frac": round(self.merged_whole / self.multi_call, 4) if self.multi_call else None,
            "sequences": self.sequences,
            **{f"split_{r}": lay.split_calls.get(r, 0) for r in SPLIT_REASONS},
            "incomplete": self.incomplete, "crossed_versions": self.crossed_versions,
            "tokens_saved_frac": round(1 - lay.sequence_tokens / lay.per_call_tokens, 4) if lay.per_call_tokens else None,
        }


def _trajectories(table: pa.Table) -> list[Trajectory]:
    """Call rows (trajectory_id, call_index, policy_version, prompt and output ids) as trajectories."""
    cols = table.select(["trajectory_id", "call_index", "policy_version", "prompt_token_ids",
                         "output_token_ids"]).to_pydict()
    by_id: dict[str, list[int]] = defaultdict(list)
    for r, tid in enumerate(cols["trajectory_id"]):
        by_id[tid].append(r)
    out = []
    for tid, rows in by_id.items():
        rows.sort(key=lambda r: cols["call_index"][r])
        calls = [Call(cols["prompt_token_ids"][r] or [], cols["output_token_ids"][r] or [], [], 1.0) for r in rows]
        out.append(Trajectory(tid, "", cols["policy_version"][rows[0]], 0.0, calls))
    return out


def merge_report(store: TrajectoryStore, policy_versions: Sequence[str] | None = None,
                 *, chunk: int = 2000) -> list[VersionMerges]:
    """The merge counts of each policy version (those of ``policy_versions`` only, when given), sorted
    by version."""
    pinned = store.versions()  # both reads see one snapshot, whatever the recorders append meanwhile
    keys = store.read_calls(columns=["trajectory_id", "call_index"], as_of=pinned).to_pydict()
    calls_of: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for tid, index, pv in zip(keys["trajectory_id"], keys["call_index"], keys["policy_version"]):
        calls_of[tid].append((index, pv))
    wanted = None if policy_versions is None else set(policy_versions)
    counts: dict[str, VersionMerges] = {}
    todo: dict[str, list[str]] = defaultdict(list)  # version -> its complete multi-call trajectories
    for tid, calls in calls_of.items():
        calls.sort()
        pv = calls[0][1]
        if wanted is not None and pv not in wanted:
            continue
        c = counts.setdefault(pv, VersionMerges(pv))
        c.trajectories += 1
        c.crossed_versions += len({v for _, v in calls}) > 1
        if [i for i, _ in calls] != list(range(len(calls))):
            c.incomplete += 1
        elif len(calls) >= 2:
            todo[pv].append(tid)
    for pv, tids in todo.items():
        for k in range(0, len(tids), chunk):
            part = tids[k:k + chunk]
            versions = sorted({v for t in part for _, v in calls_of[t]})
            table = store.read_calls(versions, trajectory_ids=part, columns=["prompt_token_ids", "output_token_ids"],
                                     as_of=pinned)
            for traj in _trajectories(table):
                counts[pv].add(traj)
    return [counts[v] for v in sorted(counts)]


def merge_rows(store: TrajectoryStore, policy_versions: Sequence[str] | None = None) -> list[dict]:
    """``merge_report`` as one plain row per policy version (``prodrl data merges``)."""
    return [c.as_row() for c in merge_report(store, policy_versions)]
