"""Several recorders in front of several serving replicas, sharing call indices and retries through
PostgreSQL (``--coordination-url``): a trajectory's calls, its retries and its feedback may reach
any replica."""

from __future__ import annotations

import pytest

from prodrl_pipelines.recorder.indexer import LocalIndexer, PostgresIndexer, make_indexer
from tests.test_recorder import fake, serving, start_recorder  # noqa: F401 - fixtures

BODY = {"prompt": [1, 2, 3], "max_tokens": 3}


def test_a_trajectory_spread_over_two_replicas_is_numbered_once(fake, start_recorder, tmp_path, pg_url):
    store = tmp_path / "store"
    a = start_recorder(fake.url, store, tokenizer_dir=None, wal_dir=str(tmp_path / "wal-a"), coordination_url=pg_url)
    b = start_recorder(fake.url, store, tokenizer_dir=None, wal_dir=str(tmp_path / "wal-b"), coordination_url=pg_url)

    def call(r, body, **headers):
        resp = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "fleet", **headers})
        assert resp.status_code == 200, resp.text
        return int(resp.headers["x-call-index"])

    assert [call(r, {**BODY, "seed": i}) for i, r in enumerate([a, b, a, b])] == [0, 1, 2, 3]
    # a client's retry (same Idempotency-Key) that reaches the other replica replaces the call
    assert call(a, {**BODY, "seed": 10}, **{"Idempotency-Key": "k"}) == 4
    assert call(b, {**BODY, "seed": 11}, **{"Idempotency-Key": "k"}) == 4
    assert call(a, {**BODY, "seed": 12}) == 5
    # feedback reaches a replica that never saw the trajectory's calls
    fresh = start_recorder(fake.url, store, tokenizer_dir=None, wal_dir=str(tmp_path / "wal-c"),
                           coordination_url=pg_url)
    fb = fresh.http.post("/v1/feedback", json={"trajectory_id": "fleet", "reward": 1.0})
    assert fb.status_code == 200, fb.text
    for r in (a, b, fresh):
        r.stop()  # stopping flushes what each replica committed
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.store import TrajectoryStore

    calls = TrajectoryStore(LocalBlobStore(store)).read_calls()
    assert sorted(calls["call_index"].to_pylist()) == [0, 1, 2, 3, 4, 5]  # one row per call
    assert TrajectoryStore(LocalBlobStore(store)).read_rewards()["trajectory_id"].to_pylist() == ["fleet"]


def test_without_coordination_each_replica_numbers_alone(fake, start_recorder, tmp_path):
    """The failure the shared indexer prevents: two in-memory recorders both hand out index 0."""
    store = tmp_path / "store"
    a = start_recorder(fake.url, store, tokenizer_dir=None, wal_dir=str(tmp_path / "wal-a"))
    b = start_recorder(fake.url, store, tokenizer_dir=None, wal_dir=str(tmp_path / "wal-b"))
    got = [int(r.http.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "t"}).headers["x-call-index"])
           for r in (a, b)]
    assert got == [0, 0]
    assert b.http.post("/v1/feedback", json={"trajectory_id": "never-here", "reward": 1.0}).status_code == 404


def test_indexers_agree(pg_url):
    """The local and the PostgreSQL indexer answer the same sequence of operations the same way."""
    local, shared = LocalIndexer(), PostgresIndexer(pg_url)
    for ix in (local, shared):
        ix.see([("s", 2), ("s", 0), ("u", 5)])
    for ix in (local, shared):
        assert (ix.known("s"), ix.known("nope"), ix.next_index("s"), ix.next_index("u")) == (True, False, 3, 6)
        assert [ix.assign("s", None, False, 1)[0], ix.assign("s", "key", True, 123), ix.assign("new", None, False, 2)[0]] \
            == [3, (4, None, False), 0]
        assert ix.assign("s", "key", True, 124) == (4, 123, True)  # a retry: the same index, superseding 123
        assert ix.assign("s", "key", False, 125) == (5, None, False)  # not a retry: a new call with that body
        assert ix.assign("s", "other", True, 126) == (6, None, False)
    shared.close()
    with pytest.raises(ValueError, match="postgresql"):
        make_indexer("redis://x")
    with pytest.raises(ValueError, match="cannot be reached"):
        make_indexer("postgresql://nobody@127.0.0.1:1/none")
