"""The sensor's eligibility count, kept up to date from what changed since its last tick.

``EligibilityTracker.count`` answers "how many trajectories could the next round take?" (an upper
bound of selection's ``n_eligible``, DESIGN.md s.5) without reading the store's history. It keeps a
small state object in the store (``_state/eligibility.parquet``): one row per trajectory that can
still become eligible, and, in the file's metadata, the table versions it has seen (its cursor).
Each tick reads only the commits after the cursor (``DeltaTables.log_since``: one LIST per table,
one GET per new commit) and the data files those commits added, folds them into the state, and
drops the trajectories the policy window has left behind. So a tick costs what arrived since the
last one plus the window's size, never the number of rounds or files before it.

Per trajectory the state keeps: the policy versions of its calls, its call indices, the calls that
fail a cheap rule (empty generation, length mismatch, output token id out of range, non-finite
output logprob) keyed by (call index, created_at) so a retraction can clear them, the latest reward
(value and time), and whether a round's ledger holds it. Eligible = every version in the window,
indices exactly 0..n-1, no failing call, a finite reward, not in a ledger.

The state is rebuilt from a snapshot (the window's calls, and the rewards, retractions and ledger
rows of those trajectories) on the first tick, when the vocabulary or the window moves back, when a
commit rewrote rows instead of appending them (a round re-materialised its ledger, a migration), or
when the log no longer reaches back to the cursor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prodrl_pipelines.storage.blobstore import BlobNotFoundError
from prodrl_pipelines.trajectories.store import CALLS, LEDGER, RETRACTIONS, REWARDS, TrajectoryStore

STATE_KEY = "_state/eligibility.parquet"
WATCHED = (CALLS, REWARDS, RETRACTIONS, LEDGER)
CALL_COLUMNS = ["trajectory_id", "call_index", "policy_version", "output_token_ids", "output_logprobs", "created_at"]
_NEVER = np.iinfo(np.int64).min


@dataclass
class _Traj:
    versions: set = field(default_factory=set)
    indices: list = field(default_factory=list)
    bad: set = field(default_factory=set)  # "call_index:created_at_us" of calls failing a cheap rule
    reward: float | None = None
    reward_at: int = _NEVER
    used: bool = False
    seen: str = ""  # the window's first version when this entry appeared (entries without calls expire by it)


@dataclass
class TickReport:
    """What one ``count`` did: ``rebuilt`` (and why), commits and data files read, state size."""

    eligible: int
    rebuilt: str | None
    commits_read: int
    files_read: int
    tracked: int


def bad_call_rows(calls: pa.Table, vocab_size: int) -> list[int]:
    """Rows of ``calls`` failing a cheap per-call rule (vectorised)."""
    n = calls.num_rows
    if n == 0:
        return []
    out = calls.column("output_token_ids").combine_chunks()
    lps = calls.column("output_logprobs").combine_chunks()
    n_out = pc.fill_null(pc.list_value_length(out), 0).to_numpy(zero_copy_only=False)
    n_lp = pc.fill_null(pc.list_value_length(lps), -1).to_numpy(zero_copy_only=False)
    bad = (n_out == 0) | (n_lp != n_out)
    row_of_out = np.repeat(np.arange(n), n_out)
    ids = pc.list_flatten(out).to_numpy(zero_copy_only=False)
    if len(ids):
        bad_ids = np.isnan(ids) if ids.dtype.kind == "f" else (ids < 0) | (ids >= vocab_size)
        bad[np.unique(row_of_out[bad_ids[: len(row_of_out)]])] = True
    flat_lp = pc.list_flatten(lps)
    if len(flat_lp):
        lp = pc.fill_null(flat_lp, np.nan).to_numpy(zero_copy_only=False)
        n_lp_pos = np.maximum(n_lp, 0)
        row_of_lp = np.repeat(np.arange(n), n_lp_pos)
        bad[np.unique(row_of_lp[~np.isfinite(lp)])] = True
    return np.flatnonzero(bad).tolist()


class EligibilityTracker:
    """Incremental eligibility count over a ``TrajectoryStore`` (see the module docstring)."""

    def __init__(self, store: TrajectoryStore, vocab_size: int) -> None:
        self.store = store
        self.vocab_size = int(vocab_size)
        self._seen = ""

    # --- state I/O ----------------------------------------------------------------------------

    def _load(self) -> tuple[dict, dict[str, _Traj]] | None:
        try:
            data = self.store.blobs.get_bytes(STATE_KEY)
        except BlobNotFoundError:
            return None
        t = pq.read_table(pa.BufferReader(data))
        meta = json.loads(t.schema.metadata[b"prodrl"])
        trajs = {}
        cols = {c: t.column(c).to_pylist() for c in t.column_names}
        for i, tid in enumerate(cols["trajectory_id"]):
            trajs[tid] = _Traj(set(cols["versions"][i]), list(cols["indices"][i]), set(cols["bad"][i]),
                               cols["reward"][i], cols["reward_at"][i], cols["used"][i], cols["seen"][i])
        return meta, trajs

    def _save(self, meta: dict, trajs: dict[str, _Traj]) -> None:
        ids = list(trajs)
        t = pa.table({
            "trajectory_id": pa.array(ids, pa.string()),
            "versions": pa.array([sorted(trajs[i].versions) for i in ids], pa.list_(pa.string())),
            "indices": pa.array([trajs[i].indices for i in ids], pa.list_(pa.int32())),
            "bad": pa.array([sorted(trajs[i].bad) for i in ids], pa.list_(pa.string())),
            "reward": pa.array([trajs[i].reward for i in ids], pa.float64()),
            "reward_at": pa.array([trajs[i].reward_at for i in ids], pa.int64()),
            "used": pa.array([trajs[i].used for i in ids], pa.bool_()),
            "seen": pa.array([trajs[i].seen for i in ids], pa.string()),
        }).replace_schema_metadata({"prodrl": json.dumps(meta)})
        sink = pa.BufferOutputStream()
        pq.write_table(t, sink, compression="zstd")
        self.store.blobs.put_bytes(STATE_KEY, sink.getvalue().to_pybytes())

    # --- folding rows into the state ----------------------------------------------------------

    def _fold_calls(self, trajs: dict[str, _Traj], calls: pa.Table) -> None:
        if calls.num_rows == 0:
            return
        bad_rows = set(bad_call_rows(calls, self.vocab_size))
        at = calls.column("created_at").cast(pa.int64()).to_pylist()
        for row, (tid, ci, v, a) in enumerate(zip(calls.column("trajectory_id").to_pylist(),
                                                  calls.column("call_index").to_pylist(),
                                                  calls.column("policy_version").to_pylist(), at)):
            tr = trajs.setdefault(tid, _Traj(seen=self._seen))
            tr.versions.add(v)
            tr.indices.append(int(ci))
            if row in bad_rows:
                tr.bad.add(f"{ci}:{a}")

    def _fold_retractions(self, trajs: dict[str, _Traj], retractions: pa.Table) -> None:
        at = retractions.column("created_at").cast(pa.int64()).to_pylist()
        for tid, ci, a in zip(retractions.column("trajectory_id").to_pylist(),
                              retractions.column("call_index").to_pylist(), at):
            tr = trajs.get(tid)
            if tr is not None:
                tr.bad.discard(f"{ci}:{a}")
                if int(ci) in tr.indices:  # the retry's row carries the same index
                    tr.indices.remove(int(ci))

    def _fold_rewards(self, trajs: dict[str, _Traj], rewards: pa.Table) -> None:
        at = pc.fill_null(rewards.column("created_at").cast(pa.int64()), _NEVER).to_pylist()
        for tid, r, a in zip(rewards.column("trajectory_id").to_pylist(), rewards.column("reward").to_pylist(), at):
            tr = trajs.setdefault(tid, _Traj(seen=self._seen))
            if a >= tr.reward_at:  # the newest reward wins; among equal times the later written
                tr.reward, tr.reward_at = r, a

    def _fold_ledger(self, trajs: dict[str, _Traj], ledger: pa.Table) -> None:
        for tid in ledger.column("trajectory_id").to_pylist():
            trajs.setdefault(tid, _Traj(seen=self._seen)).used = True

    # --- the tick -----------------------------------------------------------------------------

    def _rebuild(self, window: list[str]) -> tuple[dict[str, int], dict[str, _Traj]]:
        st = self.store
        pinned = st.versions()
        trajs: dict[str, _Traj] = {}
        calls = st.read_calls(window, dedupe=False, retracted=True, as_of=pinned,
                              columns=[c for c in CALL_COLUMNS if c not in ("trajectory_id", "call_index")])
        self._fold_calls(trajs, calls)
        ids = list(trajs)
        if ids:
            self._fold_retractions(trajs, _filtered(st.read_retractions(as_of=pinned), ids))
            self._fold_rewards(trajs, st.read_rewards(latest=False, trajectory_ids=ids, as_of=pinned))
            for tid in st.used_trajectory_ids(trajectory_ids=ids, as_of=pinned):
                trajs[tid].used = True
        return pinned, trajs

    def count(self, live_version: str, version_order: list[str], max_policy_lag: int,
              report: bool = False, needs_reward: bool = True) -> int | TickReport:
        """Eligible trajectories for the window of ``live_version`` (see the module docstring).
        ``needs_reward=False``: a scorer rewards stored traffic itself, so an unrewarded one counts."""
        from prodrl_pipelines.trajectories.rows import policy_window

        window = policy_window(live_version, version_order, max_policy_lag)
        order = {v: i for i, v in enumerate(version_order)}
        start = order[window[0]]
        self._seen = window[0]
        loaded = self._load()
        why, meta = None, None
        commits_read = files_read = 0
        if loaded is None:
            why = "first tick"
        else:
            meta, trajs = loaded
            if meta.get("vocab_size") != self.vocab_size:
                why = "vocabulary changed"
            elif order.get(meta.get("window_start"), -1) > start:
                why = "window moved back"
        if why is None:
            cursor = dict(meta["cursor"])
            for name in WATCHED:
                commits = self.store.tables.log_since(name, cursor.get(name, -1))
                if commits is None:
                    why = f"log of {name} no longer reaches version {cursor.get(name)}"
                    break
                commits_read += len(commits)
                for c in commits:
                    if not c.data_change:
                        continue  # compaction rewrote files, no row changed
                    if c.removed:
                        why = f"{name} version {c.version} ({c.operation or 'rewrite'}) removed rows"
                        break
                    files_read += len(c.added)
                    try:
                        tables = self.store.tables.read_files(
                            name, [a["path"] for a in c.added],
                            CALL_COLUMNS if name == CALLS else None, [a["partitionValues"] for a in c.added])
                    except BlobNotFoundError:
                        why = f"{name} version {c.version}'s files were vacuumed"
                        break
                    fold = {CALLS: self._fold_calls, REWARDS: self._fold_rewards,
                            RETRACTIONS: self._fold_retractions, LEDGER: self._fold_ledger}[name]
                    for t in tables:
                        fold(trajs, t)
                if why:
                    break
                if commits:
                    cursor[name] = commits[-1].version
        if why is not None:
            cursor, trajs = self._rebuild(window)
        # the window only moves forward: trajectories with a version before it never become eligible
        old = {v for v, i in order.items() if i < start}
        tracked = len(trajs)
        trajs = {tid: tr for tid, tr in trajs.items()
                 if not (tr.versions & old) and (tr.versions or order.get(tr.seen, -1) >= start)}
        inside = set(window)
        n = sum(1 for tr in trajs.values()
                if tr.versions and tr.versions <= inside and not tr.bad and not tr.used
                and (not needs_reward or (tr.reward is not None and np.isfinite(tr.reward)))
                and sorted(tr.indices) == list(range(len(tr.indices))))
        meta_now = {"vocab_size": self.vocab_size, "window_start": window[0], "cursor": cursor}
        if why is not None or commits_read or len(trajs) != tracked or meta_now != meta:  # else: nothing to write
            self._save(meta_now, trajs)
        if report:
            return TickReport(n, why, commits_read, files_read, len(trajs))
        return n


def _filtered(table: pa.Table, ids: list[str]) -> pa.Table:
    if table.num_rows == 0:
        return table
    return table.filter(pc.is_in(table.column("trajectory_id"), pa.array(ids, pa.string())))


