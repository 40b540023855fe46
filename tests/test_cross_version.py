"""Episodes whose calls were recorded under several policy versions (a rolling wave's replicas, a
canary and its fallback, a stray name): selection never trains one with a call outside the policy
window, holds it back while the other version may still enter the window, quarantines it
(``crossed_versions``) once it cannot, and the sensor's count agrees."""

from __future__ import annotations

from datetime import timedelta

import pytest
from helpers import T0, VOCAB, make_call, make_reward

from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.eligibility import STATE_KEY, EligibilityTracker
from prodrl_pipelines.trajectories.selection import InsufficientDataError, select_round_dataset
from prodrl_pipelines.trajectories.store import TrajectoryStore


@pytest.fixture
def store(tmp_path):
    return TrajectoryStore(LocalBlobStore(tmp_path / "store"))


def _call(tid, i, version, minute):
    return make_call(tid, i, policy_version=version, created_at=T0 + timedelta(minutes=minute))


def _select(store, live, order, lag, n=1):
    return select_round_dataset(store, "round-000009", live, order, lag, n, VOCAB, record=False)


def _counts(store, live, order, lag):
    """(incremental count, from-scratch count)."""
    tracker = EligibilityTracker(store, VOCAB)
    got = tracker.count(live, order, lag)
    store.blobs.delete(STATE_KEY)
    fresh = EligibilityTracker(store, VOCAB).count(live, order, lag)
    return got, fresh


def test_a_later_call_under_the_replaced_version_is_never_trained(store):
    """A rolling wave from v1 to v2: call 0 went to an updated replica (v2), call 1 to one not yet
    updated (v1). With v2 live and lag 0 the episode can never complete in the window."""
    store.write_calls([_call("ok", 0, "v2", 10), _call("ok", 1, "v2", 11)])  # v2's first calls
    store.write_calls([_call("wave", 0, "v2", 12), _call("wave", 1, "v1", 13)])
    store.write_rewards([make_reward("ok"), make_reward("wave")])
    res = _select(store, "v2", ["v1", "v2"], 0)
    assert res.trajectory_ids == ["ok"] and res.n_eligible == 1
    assert res.quarantine_counts["crossed_versions"] == 1
    assert _counts(store, "v2", ["v1", "v2"], 0) == (1, 1)
    # one-round async: both versions are in the window, so the whole episode trains
    both = _select(store, "v2", ["v1", "v2"], 1, n=2)
    assert both.trajectory_ids == ["ok", "wave"] and both.dataset.num_rows == 4


def test_a_call_under_a_canary_version_holds_the_episode_back_until_the_window_moves_on(store):
    """Call 0 on the stable live version, call 1 on a canary (a version not in the history yet):
    held back while the canary may still be promoted; promoted -> in the window with lag 1;
    passed over by a later deployment -> quarantined."""
    store.write_calls([_call("s", 0, "v1", 1), _call("s", 1, "v1", 2)])
    store.write_calls([_call("mix", 0, "v1", 3), _call("mix", 1, "cand", 4)])
    store.write_rewards([make_reward("s"), make_reward("mix")])
    held = _select(store, "v1", ["v0", "v1"], 0)
    assert held.trajectory_ids == ["s"] and held.n_eligible == 1 and held.n_pending_versions == 1
    assert held.quarantine_counts["crossed_versions"] == 0
    with pytest.raises(InsufficientDataError) as e:
        _select(store, "v1", ["v0", "v1"], 0, n=2)
    assert e.value.breakdown["pending_other_version"] == 1
    assert _counts(store, "v1", ["v0", "v1"], 0) == (1, 1)
    # the canary is promoted: with lag 1 the episode is whole in the window
    promoted = _select(store, "cand", ["v0", "v1", "cand"], 1, n=2)
    assert promoted.trajectory_ids == ["s", "mix"]
    # the canary failed and another version was deployed after it: "cand" can no longer enter
    store.write_calls([_call("new", 0, "v2", 30)])
    store.write_rewards([make_reward("new")])
    passed = _select(store, "v2", ["v0", "v1", "v2"], 1)
    assert "mix" not in passed.trajectory_ids and passed.quarantine_counts["crossed_versions"] == 1
    assert passed.n_pending_versions == 0
    assert _counts(store, "v2", ["v0", "v1", "v2"], 1) == (2, 2)  # s and new


def test_a_recorded_round_quarantines_a_crossed_episode_once(store):
    store.write_calls([_call("a", 0, "v2", 10), _call("a", 1, "v2", 11)])
    store.write_calls([_call("x", 0, "v2", 12), _call("x", 1, "v1", 13)])
    store.write_rewards([make_reward("a"), make_reward("x")])
    select_round_dataset(store, "round-000001", "v2", ["v1", "v2"], 0, 1, VOCAB)
    q = store.read_quarantine("round-000001")
    assert set(q.column("trajectory_id").to_pylist()) == {"x"}
    assert all(r.startswith("crossed_versions: ") for r in q.column("quarantine_reason").to_pylist())
    assert "x" in store.used_trajectory_ids()
