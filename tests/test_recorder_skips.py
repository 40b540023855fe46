"""The recorder's skipped calls at start: what a start reads does not grow with the flushes before it."""

from __future__ import annotations

from prodrl_pipelines.recorder.ingest import SKIPPED_PREFIX, Ingestor
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore


class CountingBlobs(LocalBlobStore):
    def __init__(self, root):
        super().__init__(root)
        self.gets: list[str] = []

    def get_bytes(self, key):
        self.gets.append(key)
        return super().get_bytes(key)


def _skip_flushes(ing: Ingestor, n: int, tid: str) -> None:
    for _ in range(n):
        _, fut, _ = ing.commit_skip(tid, "upstream_missing_logprobs")
        fut.result(10)
        assert ing.flush(10)


def test_a_start_reads_one_folded_part_of_skips_plus_those_flushed_since(tmp_path):
    blobs = CountingBlobs(tmp_path / "store")
    store = TrajectoryStore(blobs)
    ing = Ingestor(store, tmp_path / "wal", flush_interval_s=0)
    ing.start()
    _skip_flushes(ing, 12, "a")
    ing.stop()
    assert len(blobs.list(SKIPPED_PREFIX)) == 12  # one part per flush with skips

    again = Ingestor(store, tmp_path / "wal", flush_interval_s=0)
    again.recover()
    assert again.next_index("a") == 12  # every skip still takes its index
    assert len(blobs.list(SKIPPED_PREFIX)) == 1  # folded into one part
    again.start()
    _skip_flushes(again, 2, "b")
    again.stop()

    blobs.gets.clear()
    third = Ingestor(store, tmp_path / "wal", flush_interval_s=0)
    third.recover()
    assert (third.next_index("a"), third.next_index("b")) == (12, 2)
    assert sum(k.startswith(SKIPPED_PREFIX) for k in blobs.gets) == 3  # the folded part + two new ones
