"""`prodrl data migrate` where it meets a store still being written in the earlier layout: parts
written after a completed migration are migrated before anything is deleted, and parts are read in
bounded batches (one commit each), resumable after a failure half-way."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import make_reward, make_trajectory

from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.migrate import MigrationError, migrate
from prodrl_pipelines.trajectories.store import CALLS, TrajectoryStore


def _part_key(seq: int, version: str = "v1") -> str:
    return f"trajectories/policy_version={version}/part-0190a000-0000-7000-8000-{seq:012d}.parquet"


def _legacy_part(blobs, key: str, rows: list[dict]) -> None:
    t = pa.Table.from_pylist(rows)
    t = t.drop_columns([c for c in ("policy_version",) if c in t.column_names])  # calls: in the key
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink)
    blobs.put_bytes(key, sink.getvalue().to_pybytes())


def test_delete_legacy_migrates_parts_written_after_a_completed_migration(tmp_path, capsys):
    """An old recorder keeps writing parts after the migration ran: `--delete-legacy` migrates them
    first (their rows reach the table), and deletes only parts whose rows are all in the table."""
    from prodrl_pipelines.cli.main import main

    settings = tmp_path / "s.json"
    settings.write_text(json.dumps({"home": str(tmp_path / "home")}))
    store = TrajectoryStore(LocalBlobStore(tmp_path / "home" / "store"))
    _legacy_part(store.blobs, _part_key(1), make_trajectory("early", 2, policy_version="v1"))
    _legacy_part(store.blobs, "rewards/part-0190a000-0000-7000-8000-000000000002.parquet", [make_reward("early")])
    assert main(["data", "migrate", "--settings", str(settings)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["calls"]["migrated_now"] == 2
    # the old recorder, still running, writes one more part of each kind
    _legacy_part(store.blobs, _part_key(3), make_trajectory("late", 3, policy_version="v1"))
    _legacy_part(store.blobs, "rewards/part-0190a000-0000-7000-8000-000000000004.parquet", [make_reward("late")])
    assert main(["data", "migrate", "--settings", str(settings), "--delete-legacy"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calls"]["migrated_now"] == 3 and report["calls"]["legacy_deleted"] == 2
    store = TrajectoryStore(LocalBlobStore(tmp_path / "home" / "store"))
    calls = store.read_calls(dedupe=False)
    assert sorted(set(calls["trajectory_id"].to_pylist())) == ["early", "late"] and calls.num_rows == 5
    assert sorted(store.read_rewards()["trajectory_id"].to_pylist()) == ["early", "late"]
    assert store.blobs.list("trajectories/") == [] and store.blobs.list("rewards/") == []


def test_migration_streams_bounded_batches_and_resumes_after_a_bad_part(tmp_path):
    """Parts are read and committed a batch at a time (no commit holds more than the bound); a part
    that cannot be read stops the migration with its name, keeps every legacy part, and a rerun once
    it is repaired migrates the rest exactly once."""
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    for seq in range(1, 8):
        _legacy_part(store.blobs, _part_key(seq), make_trajectory(f"t{seq}", 2, policy_version="v1"))
    good = store.blobs.get_bytes(_part_key(6))
    store.blobs.put_bytes(_part_key(6), b"torn write")
    with pytest.raises(MigrationError, match=_part_key(6)):
        migrate(store, delete_legacy=True, batch_rows=4)
    assert len(store.blobs.list("trajectories/")) == 7  # nothing deleted on failure
    partial = store.read_calls(dedupe=False).num_rows
    assert 0 < partial < 14  # the batches before the bad part landed
    store.blobs.put_bytes(_part_key(6), good)
    report = migrate(store, delete_legacy=True, batch_rows=4)
    assert report[CALLS]["migrated_now"] == 14 - partial and report[CALLS]["rows"] == 14
    calls = store.read_calls(dedupe=False)
    ids = list(zip(calls["trajectory_id"].to_pylist(), calls["call_index"].to_pylist()))
    assert len(ids) == len(set(ids)) == 14  # every row once
    per_commit = _rows_per_commit(store)
    assert per_commit and max(per_commit) <= 4 and sum(per_commit) == 14
    assert store.blobs.list("trajectories/") == []


def _rows_per_commit(store: TrajectoryStore) -> list[int]:
    """Rows each data commit of the calls table added (from the add actions' statistics)."""
    out = []
    v = 0
    while True:
        key = f"tables/{CALLS}/_delta_log/{v:020d}.json"
        try:
            text = store.blobs.get_bytes(key).decode()
        except Exception:
            return out
        n = 0
        for line in text.splitlines():
            action = json.loads(line) if line.strip() else {}
            if "add" in action:
                n += int(json.loads(action["add"].get("stats") or "{}").get("numRecords", 0))
        if n:
            out.append(n)
        v += 1
