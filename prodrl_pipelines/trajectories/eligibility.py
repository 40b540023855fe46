"""The sensor's eligibility count, kept up to date from what changed since its last tick.

``EligibilityTracker.count`` answers "how many trajectories could the next round take?" (an upper
bound of selection's ``n_eligible``, DESIGN.md s.5) without reading the store's history. It keeps a
small state object in the store (``_state/eligibility.parquet``): one row per trajectory it has
seen calls, rewards, retractions or ledger rows of, and, in the file's metadata, the table versions
it has seen (its cursor), the window it counted for and the window's first call. Each tick reads
only the commits after the cursor (``DeltaTables.log_since``: one LIST per table, one GET per new
commit) and the data files those commits added, and folds them into the state. So a tick costs
what arrived since the last one plus the state's size, never the number of rounds or files before it.

The state sees exactly the calls selection sees (``crossing``): every call under the window's
versions, and the calls recorded since the window's first call under its predecessor and under
versions not in the history; other calls are not folded. Per trajectory it keeps a *set* of call
rows (call index, created_at, policy version, whether the row fails a cheap rule: empty generation,
length mismatch, output token id out of range, non-finite output logprob) and a *set* of retracted
(call index, created_at) keys, so identical duplicate rows, a retraction stored twice, and a
retraction committed before the row it retracts all fold to what a read from scratch gives; also
the latest reward (value and time) and whether a round's ledger holds it. Eligible = its rows less
the retracted ones are all under the window's versions, their distinct call indices are exactly
0..n-1, none fails a cheap rule, its reward is finite, no ledger holds it.

The state is rebuilt from a snapshot (the window's calls, the outside calls as above, the rewards,
retractions and ledger rows of those trajectories, and every reward and retraction since the
window's first call: one may have been committed before its calls) on the first tick; when the vocabulary
changes; when the window gains a version (a deployment, a rollback, a larger lag: any of these can
bring back trajectories the state dropped) or its predecessor was not seen before; when the
window's first call moves earlier (a late commit); when a commit rewrote rows instead of appending
them (a round re-materialised its ledger, a migration); or when the log no longer reaches back to
the cursor. When the window only shrinks, the calls it no longer sees are dropped in place.

Expiry: calls under a version that never enters the history (a failed canary, a stray name) are
seen only while they are not older than the window's first call, so the next deployment (a
rebuild) forgets them; rewards, retractions and ledger rows of trajectories without a call the
state sees are kept until then too (one of them may be the first row of a trajectory to arrive).
All of this is what the window's era wrote, never the history before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prodrl_pipelines.storage.blobstore import BlobNotFoundError
from prodrl_pipelines.trajectories.crossing import Window
from prodrl_pipelines.trajectories.store import CALLS, LEDGER, RETRACTIONS, REWARDS, TrajectoryStore

STATE_KEY = "_state/eligibility.parquet"
WATCHED = (CALLS, REWARDS, RETRACTIONS, LEDGER)
CALL_COLUMNS = ["trajectory_id", "call_index", "policy_version", "output_token_ids", "output_logprobs", "created_at"]
_NEVER = np.iinfo(np.int64).min


@dataclass
class _Traj:
    rows: set = field(default_factory=set)  # (call_index, created_at_us | None, policy_version, bad)
    retracted: set = field(default_factory=set)  # (call_index, created_at_us)
    reward: float | None = None
    reward_at: int = _NEVER
    used: bool = False

    def live_rows(self) -> list[tuple]:
        return [r for r in self.rows if (r[0], r[1]) not in self.retracted]


@dataclass
class TickReport:
    """What one ``count`` did: ``rebuilt`` (and why), commits and data files read, state size."""

    eligible: int
    rebuilt: str | None
    commits_read: int
    files_read: int
    tracked: int
    recorded: int = 0  # trajectories whose calls are all under the window's versions
    rewarded: int = 0  # ... of those with a finite reward


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


class _Sight:
    """Which calls the state holds for a window (``crossing``): every call under the window's
    versions; from ``since`` on (the window's first call), those under the predecessor and under
    versions not in the history."""

    def __init__(self, win: Window, since: int | None) -> None:
        self.inside = set(win.versions)
        self.skipped = set(win.skipped)
        self.since = since

    def sees(self, version: str, at: int | None) -> bool:
        if version in self.inside:
            return True
        return version not in self.skipped and self.since is not None and at is not None and at >= self.since


def _first_inside(trajs: dict[str, _Traj], inside: set[str]) -> int | None:
    ats = [r[1] for tr in trajs.values() for r in tr.rows if r[2] in inside and r[1] is not None]
    return min(ats) if ats else None


class EligibilityTracker:
    """Incremental eligibility count over a ``TrajectoryStore`` (see the module docstring)."""

    def __init__(self, store: TrajectoryStore, vocab_size: int) -> None:
        self.store = store
        self.vocab_size = int(vocab_size)

    # --- state I/O ----------------------------------------------------------------------------

    def _load(self) -> tuple[dict, dict[str, _Traj]] | None:
        try:
            data = self.store.blobs.get_bytes(STATE_KEY)
        except BlobNotFoundError:
            return None
        t = pq.read_table(pa.BufferReader(data))
        meta = json.loads(t.schema.metadata[b"prodrl"])
        if "window" not in meta:
            return meta, {}  # an older state layout: rebuilt
        trajs = {}
        c = {name: t.column(name).to_pylist() for name in t.column_names}
        for i, tid in enumerate(c["trajectory_id"]):
            trajs[tid] = _Traj(set(zip(c["row_index"][i], c["row_at"][i], c["row_version"][i], c["row_bad"][i])),
                               set(zip(c["retracted_index"][i], c["retracted_at"][i])),
                               c["reward"][i], c["reward_at"][i], c["used"][i])
        return meta, trajs

    def _save(self, meta: dict, trajs: dict[str, _Traj]) -> None:
        ids = list(trajs)
        rows = [sorted(trajs[i].rows, key=repr) for i in ids]
        ret = [sorted(trajs[i].retracted) for i in ids]

        def col(lists, k, typ):
            return pa.array([[r[k] for r in rs] for rs in lists], pa.list_(typ))

        t = pa.table({
            "trajectory_id": pa.array(ids, pa.string()),
            "row_index": col(rows, 0, pa.int32()),
            "row_at": col(rows, 1, pa.int64()),
            "row_version": col(rows, 2, pa.string()),
            "row_bad": col(rows, 3, pa.bool_()),
            "retracted_index": col(ret, 0, pa.int32()),
            "retracted_at": col(ret, 1, pa.int64()),
            "reward": pa.array([trajs[i].reward for i in ids], pa.float64()),
            "reward_at": pa.array([trajs[i].reward_at for i in ids], pa.int64()),
            "used": pa.array([trajs[i].used for i in ids], pa.bool_()),
        }).replace_schema_metadata({"prodrl": json.dumps(meta)})
        sink = pa.BufferOutputStream()
        pq.write_table(t, sink, compression="zstd")
        self.store.blobs.put_bytes(STATE_KEY, sink.getvalue().to_pybytes())

    # --- folding rows into the state ----------------------------------------------------------

    def _fold_calls(self, trajs: dict[str, _Traj], calls: pa.Table, sight: _Sight) -> None:
        if calls.num_rows == 0:
            return
        bad_rows = set(bad_call_rows(calls, self.vocab_size)) if "output_token_ids" in calls.column_names else set()
        at = calls.column("created_at").cast(pa.int64()).to_pylist()
        for row, (tid, ci, v, a) in enumerate(zip(calls.column("trajectory_id").to_pylist(),
                                                  calls.column("call_index").to_pylist(),
                                                  calls.column("policy_version").to_pylist(), at)):
            if sight.sees(v, a):
                trajs.setdefault(tid, _Traj()).rows.add((int(ci), a, v, row in bad_rows))

    def _fold_retractions(self, trajs: dict[str, _Traj], retractions: pa.Table) -> None:
        # kept even before the row they retract arrives (another writer may commit it later)
        at = retractions.column("created_at").cast(pa.int64()).to_pylist()
        for tid, ci, a in zip(retractions.column("trajectory_id").to_pylist(),
                              retractions.column("call_index").to_pylist(), at):
            trajs.setdefault(tid, _Traj()).retracted.add((int(ci), a))

    def _fold_rewards(self, trajs: dict[str, _Traj], rewards: pa.Table) -> None:
        at = pc.fill_null(rewards.column("created_at").cast(pa.int64()), _NEVER).to_pylist()
        for tid, r, a in zip(rewards.column("trajectory_id").to_pylist(), rewards.column("reward").to_pylist(), at):
            tr = trajs.setdefault(tid, _Traj())
            if a >= tr.reward_at:  # the newest reward wins; among equal times the later written
                tr.reward, tr.reward_at = r, a

    def _fold_ledger(self, trajs: dict[str, _Traj], ledger: pa.Table) -> None:
        for tid in ledger.column("trajectory_id").to_pylist():
            trajs.setdefault(tid, _Traj()).used = True

    # --- the tick -----------------------------------------------------------------------------

    def _rebuild(self, win: Window) -> tuple[dict[str, int], dict[str, _Traj], int | None]:
        st = self.store
        pinned = st.versions()
        trajs: dict[str, _Traj] = {}
        calls = st.read_calls(win.versions, dedupe=False, retracted=True, as_of=pinned,
                              columns=[c for c in CALL_COLUMNS if c not in ("trajectory_id", "call_index")])
        since = None
        if calls.num_rows:
            ats = pc.min(calls.column("created_at").cast(pa.int64())).as_py()
            since = None if ats is None else int(ats)
        sight = _Sight(win, since)
        self._fold_calls(trajs, calls, sight)
        if since is not None:
            outside = st.read_call_keys(skip_versions=win.outside_partitions_skipped(), since=since, as_of=pinned)
            self._fold_calls(trajs, outside, sight)
        ids = list(trajs)
        if ids:
            self._fold_retractions(trajs, st.read_retractions(trajectory_ids=ids, as_of=pinned))
            self._fold_rewards(trajs, st.read_rewards(latest=False, trajectory_ids=ids, as_of=pinned))
            for tid in st.used_trajectory_ids(trajectory_ids=ids, as_of=pinned):
                trajs[tid].used = True
        if since is not None:
            # rewards and retractions of calls the state sees may have been committed before those
            # calls (another writer, a commit between two ticks): every one since the window's
            # first call is kept, as the ticks keep them (folding twice changes nothing)
            self._fold_retractions(trajs, st.read_retractions(since=since, as_of=pinned))
            self._fold_rewards(trajs, st.read_rewards(latest=False, since=since, as_of=pinned))
        return pinned, trajs, since

    def _why_rebuild(self, meta: dict | None, win: Window) -> str | None:
        if meta is None:
            return "first tick"
        if meta.get("vocab_size") != self.vocab_size:
            return "vocabulary changed"
        if "window" not in meta:
            return "state written by an older version"
        before = set(meta["window"])
        gained = [v for v in win.versions if v not in before]
        if gained:
            return f"the window gained {gained}"
        if win.predecessor is not None and win.predecessor not in before | {meta.get("predecessor")}:
            return f"the window's predecessor {win.predecessor!r} was not seen"
        return None

    def count(self, live_version: str, version_order: list[str], max_policy_lag: int,
              report: bool = False, needs_reward: bool = True) -> int | TickReport:
        """Eligible trajectories for the window of ``live_version`` (see the module docstring).
        ``needs_reward=False``: a scorer rewards stored traffic itself, so an unrewarded one counts."""
        win = Window.of(live_version, version_order, max_policy_lag)
        loaded = self._load()
        meta, trajs = loaded if loaded is not None else (None, {})
        why = self._why_rebuild(meta, win)
        commits_read = files_read = 0
        since = None if meta is None else meta.get("since")
        if why is None:
            sight = _Sight(win, since)
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
                    for t in tables:
                        if name == CALLS:
                            self._fold_calls(trajs, t, sight)
                        else:
                            {REWARDS: self._fold_rewards, RETRACTIONS: self._fold_retractions,
                             LEDGER: self._fold_ledger}[name](trajs, t)
                if why:
                    break
                if commits:
                    cursor[name] = commits[-1].version
        if why is None:
            first = _first_inside(trajs, set(win.versions))
            if first is not None and (since is None or first < since):
                why = "the window's first call moved earlier"  # outside calls after it were not folded
            elif (win.versions, win.predecessor, first) != (meta["window"], meta.get("predecessor"), since):
                since = first  # the window shrank: it sees less
                sight = _Sight(win, since)
                for tr in trajs.values():
                    tr.rows = {r for r in tr.rows if sight.sees(r[2], r[1])}
        if why is not None:
            cursor, trajs, since = self._rebuild(win)
        inside = set(win.versions)
        n = recorded = rewarded = 0
        for tr in trajs.values():
            rows = tr.live_rows()
            if not rows or not all(r[2] in inside for r in rows):
                continue
            recorded += 1
            has_reward = tr.reward is not None and bool(np.isfinite(tr.reward))
            rewarded += has_reward
            if not tr.used and not any(r[3] for r in rows) and (not needs_reward or has_reward):
                idx = {r[0] for r in rows}
                n += min(idx) == 0 and max(idx) == len(idx) - 1
        meta_now = {"vocab_size": self.vocab_size, "window": win.versions, "predecessor": win.predecessor,
                    "since": since, "cursor": cursor}
        if why is not None or commits_read or meta_now != meta:  # else: nothing to write
            self._save(meta_now, trajs)
        if report:
            return TickReport(n, why, commits_read, files_read, len(trajs), recorded, rewarded)
        return n
