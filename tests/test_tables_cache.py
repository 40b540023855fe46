"""The store's open-table cache: bounded over a long-running writer, and never handing out a
snapshot that maintenance has since moved to another version."""

from __future__ import annotations

import gc

from helpers import make_trajectory

from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories import maintenance
from prodrl_pipelines.trajectories.store import CALLS, TrajectoryStore

A_HANDFUL = 16  # snapshots a process may keep open, however long it runs


def _live_delta_tables() -> int:
    from deltalake import DeltaTable

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, DeltaTable))


def test_open_snapshots_stay_bounded_over_many_appends(tmp_path):
    """A recorder appends for days: the snapshots it opened along the way are not all kept."""
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    before = _live_delta_tables()
    for k in range(60):
        store.write_calls(make_trajectory(f"t{k}", 1, policy_version="v1"), txn=("writer", k + 1))
        store.tables.txn_version(CALLS, "writer")
        store.read_calls(["v1"], as_of={CALLS: store.tables.version(CALLS)})  # a reader pinning each version
    assert store.tables.version(CALLS) >= 60
    assert _live_delta_tables() - before <= A_HANDFUL


def test_a_pinned_version_reads_the_same_after_compaction(tmp_path):
    """Compaction commits a new version; a version opened (and cached) before it still reads as itself."""
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    for k in range(4):
        store.write_calls(make_trajectory(f"t{k}", 2, policy_version="v1"))
    v = store.tables.version(CALLS)
    files_before = len(store.tables.open(CALLS, v).file_uris())
    maintenance.compact(store, [CALLS])
    assert store.tables.version(CALLS) == v + 1
    pinned = store.tables.open(CALLS, v)
    assert pinned.version() == v and len(pinned.file_uris()) == files_before
    assert store.read_calls(["v1"], as_of={CALLS: v}).num_rows == 8
