"""The sensor's incremental eligibility count equals a count from scratch after every commit, and
is never below what selection would take.

One hand-made case per way it drifted (identical duplicate rows, a retraction committed before the
call it retracts, the same retraction stored twice, a rollback with ``max_policy_lag: 0``, versions
that never enter the history), then a seeded random walk: several writers whose commits interleave,
a tick between any two commits, retries, duplicates, late and re-scored rewards, compaction, rounds
(selection and its ledger), deployments with rolling waves, canaries that pass or fail, rollbacks.
"""

from __future__ import annotations

import math
from datetime import timedelta

import numpy as np
import pytest
from helpers import T0, VOCAB, make_call, make_reward

from prodrl_pipelines.storage.blobstore import BlobNotFoundError, LocalBlobStore
from prodrl_pipelines.trajectories import maintenance
from prodrl_pipelines.trajectories.eligibility import STATE_KEY, EligibilityTracker
from prodrl_pipelines.trajectories.selection import InsufficientDataError, select_round_dataset
from prodrl_pipelines.trajectories.store import TrajectoryStore


@pytest.fixture
def store(tmp_path):
    return TrajectoryStore(LocalBlobStore(tmp_path / "store"))


def _at(seconds: float):
    return T0 + timedelta(seconds=seconds)


def _call(tid, i, version="v1", s=0.0, **kw):
    return make_call(tid, i, policy_version=version, created_at=_at(s), **kw)


def from_scratch(store, live, order, lag) -> int:
    """A fresh tracker's count, leaving the incremental tracker's state as it was."""
    try:
        saved = store.blobs.get_bytes(STATE_KEY)
    except BlobNotFoundError:
        saved = None
    store.blobs.delete(STATE_KEY, missing_ok=True)
    n = EligibilityTracker(store, VOCAB).count(live, order, lag)
    if saved is None:
        store.blobs.delete(STATE_KEY, missing_ok=True)
    else:
        store.blobs.put_bytes(STATE_KEY, saved)
    return n


def selectable(store, live, order, lag) -> int:
    try:
        return select_round_dataset(store, "round-check", live, order, lag, 1, VOCAB, record=False).n_eligible
    except InsufficientDataError as e:
        return e.n_eligible


def check(store, tracker, live, order, lag, what=""):
    inc = tracker.count(live, order, lag)
    fresh = from_scratch(store, live, order, lag)
    sel = selectable(store, live, order, lag)
    assert inc == fresh and inc >= sel, f"{what}: incremental {inc}, from scratch {fresh}, selection {sel}"
    return inc


# ----------------------------------------------------------------------------- one case each


def test_an_identical_duplicate_row_does_not_hide_a_trajectory(store):
    tracker = EligibilityTracker(store, VOCAB)
    store.write_calls([_call("a", 0), _call("a", 1, s=1), _call("b", 0)])
    store.write_rewards([make_reward("a"), make_reward("b")])
    assert check(store, tracker, "v1", ["v0", "v1"], 0) == 2
    store.write_calls([_call("a", 1, s=1)])  # re-appended: validation keeps the first copy
    assert check(store, tracker, "v1", ["v0", "v1"], 0, "after the duplicate") == 2


def test_a_retraction_committed_before_its_call_still_retracts_it(store):
    """A retry reached another replica, which committed the retraction and the retry's row before
    the first replica committed the superseded row."""
    tracker = EligibilityTracker(store, VOCAB)
    store.write_calls([_call("a", 0)])
    store.write_rewards([make_reward("a")])
    store.retract_calls([{"trajectory_id": "a", "call_index": 1, "created_at": _at(1)}])
    check(store, tracker, "v1", ["v0", "v1"], 0, "retraction alone")
    store.write_calls([_call("a", 1, s=2)])  # the retry, on a stable replica
    check(store, tracker, "v1", ["v0", "v1"], 0, "retry")
    store.write_calls([_call("a", 1, "cand", 1)])  # the superseded row (a canary answered too late), late
    assert check(store, tracker, "v1", ["v0", "v1"], 0, "superseded row") == 1


def test_a_retraction_stored_twice_removes_one_row(store):
    tracker = EligibilityTracker(store, VOCAB)
    store.write_calls([_call("a", 0), _call("a", 1, s=1)])
    store.write_rewards([make_reward("a")])
    check(store, tracker, "v1", ["v0", "v1"], 0)
    gone = {"trajectory_id": "a", "call_index": 1, "created_at": _at(1)}
    store.write_calls([_call("a", 1, s=2)])
    store.retract_calls([gone])
    store.retract_calls([gone])  # a replayed write-ahead log stores it again
    store.write_calls([_call("a", 2, s=3)])
    assert check(store, tracker, "v1", ["v0", "v1"], 0, "twice") == 1


def test_a_rollback_with_lag_zero_brings_back_the_old_versions_trajectories(store):
    tracker = EligibilityTracker(store, VOCAB)
    store.write_calls([_call("old", 0, "v1", 0), _call("new", 0, "v2", 10)])
    store.write_rewards([make_reward("old"), make_reward("new")])
    assert check(store, tracker, "v2", ["v0", "v1", "v2"], 0) == 1
    # the ledger moves the rolled-back version to the end of the history
    assert check(store, tracker, "v1", ["v0", "v2", "v1"], 0, "after the rollback") == 1
    assert tracker.count("v1", ["v0", "v2", "v1"], 1) == 2


def test_versions_that_never_enter_the_history_leave_the_state(store):
    tracker = EligibilityTracker(store, VOCAB)
    store.write_calls([_call("s", 0, "v1", 1)])
    tracker.count("v1", ["v0", "v1"], 0)  # the canary's traffic then arrives through ticks
    store.write_calls([_call(f"c{i}", 0, "canary", 5 + i) for i in range(5)])
    store.write_rewards([make_reward(f"c{i}") for i in range(5)] + [make_reward("s")])
    check(store, tracker, "v1", ["v0", "v1"], 0)
    # the canary failed; the next round deployed v2 (its first call after the canary's)
    store.write_calls([_call("n", 0, "v2", 20)])
    store.write_rewards([make_reward("n")])
    rep = tracker.count("v2", ["v0", "v1", "v2"], 0, report=True)
    assert rep.eligible == 1 and rep.tracked == 1, rep  # n; the canary's trajectories forgotten


def test_a_late_commit_that_moves_the_window_start_earlier(store):
    """A replica's late commit holds the window's earliest call: calls outside the window recorded
    since that earlier time now count against their trajectory (clocks of two replicas disagree)."""
    tracker = EligibilityTracker(store, VOCAB)
    store.write_calls([_call("x", 1, "cand", 5)])  # x's second call, on a canary replica
    store.write_calls([_call("y", 0, "v1", 10)])
    check(store, tracker, "v1", ["v0", "v1"], 0, "before")
    store.write_calls([_call("z", 0, "v1", 2)])  # committed late, recorded first
    store.write_calls([_call("x", 0, "v1", 12)])
    store.write_rewards([make_reward("x"), make_reward("y"), make_reward("z")])
    assert check(store, tracker, "v1", ["v0", "v1"], 0, "after") == 2  # y and z; x is held back


def test_a_recorder_whose_clock_runs_behind_rebuilds_once_not_every_tick(store):
    """Two recorders behind one balancer, the second's clock 3 s behind the first's. Its first commit
    holds the window's earliest call: one rebuild (outside calls recorded since then were never
    folded). Every later commit of either recorder is stamped after that call, so the ticks after
    it read only what arrived, and each equals a count from scratch."""
    order = ["v0", "v1"]
    store.write_calls([_call("old", 0, "v0", 0)])
    tracker = EligibilityTracker(store, VOCAB)
    tracker.count("v1", order, 0)  # v1 deployed, no call under it yet
    reasons = []
    for k in range(8):
        now = 100 + 2 * k  # real time; recorder a stamps it, recorder b stamps it 3 s early
        wave = "v0" if k == 2 else "v1"  # a replica not yet updated answered a's second call
        commits = [[_call(f"a{k}", 0, "v1", now), _call(f"a{k}", 1, wave, now + 0.5)],
                   [_call(f"b{k}", 0, "v1", now + 1 - 3)]]
        for rows in commits:
            store.write_calls(rows)
            store.write_rewards([make_reward(r["trajectory_id"]) for r in rows])
            rep = tracker.count("v1", order, 0, report=True)
            reasons.append(rep.rebuilt)
            assert rep.eligible == from_scratch(store, "v1", order, 0), (k, rep)
    moved = "the window's first call moved earlier"
    # a's first call (no v1 call before it), then b's first call 2 s before it; then never again
    assert reasons == [moved, moved] + [None] * (len(reasons) - 2), reasons
    assert check(store, tracker, "v1", order, 0, "at the end") == 15  # a2 crossed into v0


# ----------------------------------------------------------------------------- the random walk


class World:
    """Recorded traffic, writers, rounds and deployments driven by one seeded generator."""

    def __init__(self, store, seed):
        self.store, self.rng = store, np.random.default_rng(seed)
        self.order, self.live, self.lag = ["v0"], "v0", int(seed % 2)
        self.canary = None  # a canary's version while one runs
        self.wave_from = None  # the replaced version while a rolling wave still serves it
        self.clock = 0.0
        self.writers: list[list[tuple[str, list]]] = [[], [], []]
        self.open: dict[str, dict] = {}  # trajectory -> its version and next index
        self.rows: list[dict] = []  # every call row queued (for retries and duplicates)
        self.tids: list[str] = []
        self.n_versions = 1
        self.rounds = 0

    def tick_clock(self):
        self.clock += float(self.rng.integers(1, 30))
        return _at(self.clock)

    def queue(self, kind, rows):
        self.writers[int(self.rng.integers(len(self.writers)))].append((kind, rows))

    def serving(self):
        choices = [self.live]
        if self.wave_from:
            choices.append(self.wave_from)
        if self.canary:
            choices.append(self.canary)
        return choices[int(self.rng.integers(len(choices)))]

    def call(self):
        rng = self.rng
        if not self.open or rng.random() < 0.4:
            tid = f"t{len(self.tids)}"
            self.tids.append(tid)
            self.open[tid] = {"v": self.serving(), "next": 0}
        tid = list(self.open)[int(rng.integers(len(self.open)))]
        st = self.open[tid]
        if rng.random() < 0.15:
            st["v"] = self.serving()  # a replica of another version took this call
        row = make_call(tid, st["next"], policy_version=st["v"], created_at=self.tick_clock())
        if rng.random() < 0.08:
            row["output_logprobs"] = row["output_logprobs"][:-1] + [math.inf]
        st["next"] += 1
        self.rows.append(row)
        self.queue("calls", [row])
        if rng.random() < 0.35:
            del self.open[tid]
            if rng.random() < 0.85:
                self.queue("rewards", [{**make_reward(tid, float(rng.random())), "created_at": self.tick_clock()}])

    def retry(self):
        if not self.rows:
            return
        recent = self.rows[-6:]  # often still queued: its retraction may be committed first
        old = recent[int(self.rng.integers(len(recent)))]
        new = {**old, "created_at": self.tick_clock(), "policy_version": self.live}  # retried on a stable replica
        self.rows.append(new)
        key = {k: old[k] for k in ("trajectory_id", "call_index", "created_at")}
        self.queue("retract", [key])  # maybe another writer than the retry's row
        self.queue("calls", [new])
        if self.rng.random() < 0.2:
            self.queue("retract", [key])  # a replayed log stores it again

    def duplicate(self):
        if self.rows:
            self.queue("calls", [dict(self.rows[int(self.rng.integers(len(self.rows)))])])

    def rescore(self):
        if self.tids:
            tid = self.tids[int(self.rng.integers(len(self.tids)))]
            r = float(self.rng.choice([self.rng.random(), math.nan, 0.5]))
            self.queue("rewards", [{**make_reward(tid, r), "created_at": self.tick_clock()}])

    def commit(self):
        busy = [w for w in self.writers if w]
        if not busy:
            return
        kind, rows = busy[int(self.rng.integers(len(busy)))].pop(0)
        {"calls": self.store.write_calls, "rewards": self.store.write_rewards,
         "retract": self.store.retract_calls}[kind](rows)

    def deploy(self, version):
        self.wave_from = self.live if self.rng.random() < 0.7 else None
        self.order = [v for v in self.order if v != version] + [version]
        self.live = version

    def round(self):
        self.rounds += 1
        try:
            select_round_dataset(self.store, f"round-{self.rounds:06d}", self.live, self.order, self.lag,
                                 int(self.rng.integers(1, 3)), VOCAB)
        except InsufficientDataError:
            return
        if self.rng.random() < 0.6:
            self.new_version()

    def new_version(self):
        if self.canary is None:  # no deployment while a canary runs
            self.deploy(f"v{self.n_versions}")
            self.n_versions += 1

    def canary_step(self):
        if self.canary is None:
            self.canary = f"v{self.n_versions}"
            self.n_versions += 1
        else:
            if self.rng.random() < 0.5:
                self.deploy(self.canary)  # promoted
            self.canary = None  # else failed: its version never enters the history

    def rollback(self):
        if len(self.order) >= 2:
            self.deploy(self.order[int(self.rng.integers(len(self.order) - 1))])
            self.wave_from = None

    def step(self):
        op = self.rng.choice(["call"] * 6 + ["commit"] * 8 + ["retry", "retry", "duplicate", "rescore", "round", "canary",
                                                              "rollback", "rollback", "compact", "wave_end", "lag",
                                                              "new_version"])
        if op == "compact":
            maintenance.compact(self.store)
        elif op == "wave_end":
            self.wave_from = None
        elif op == "lag":
            self.lag = 1 - self.lag
        elif op == "new_version":
            self.new_version()
        elif op == "canary":
            self.canary_step()
        else:
            getattr(self, op)()
        return str(op)


@pytest.mark.parametrize("seed", [3, 8, 21])
def test_incremental_count_equals_a_count_from_scratch_after_every_step(store, seed):
    world = World(store, seed)
    tracker = EligibilityTracker(store, VOCAB)
    for step in range(120):
        op = world.step()
        check(store, tracker, world.live, world.order, world.lag, f"seed {seed} step {step} ({op})")
