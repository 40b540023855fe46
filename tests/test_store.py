"""Trajectory store: blob store semantics, Parquet round trips, partitions, dedupe, ledger, JSON."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from helpers import T0, make_call, make_reward, make_trajectory

from prodrl_pipelines.storage import documents
from prodrl_pipelines.storage import blobstore as blobstore_mod
from prodrl_pipelines.storage.blobstore import BlobNotFoundError, LocalBlobStore
from prodrl_pipelines.trajectories.schema import CALL_SCHEMA, QUARANTINE_SCHEMA, REWARD_SCHEMA
from prodrl_pipelines.trajectories.store import SchemaMismatchError, TrajectoryStore, uuid7


@pytest.fixture
def blobs(tmp_path):
    return LocalBlobStore(tmp_path / "store")


@pytest.fixture
def store(blobs):
    return TrajectoryStore(blobs)


# ----------------------------------------------------------------------------- blob store


def test_blobstore_put_get_list_delete(blobs):
    blobs.put_bytes("b/2.bin", b"two")
    blobs.put_bytes("a/1.bin", b"one")
    blobs.put_bytes("b/sub/3.bin", b"three")
    blobs.put_bytes("b/2.bin", b"TWO")  # overwrite
    assert blobs.get_bytes("b/2.bin") == b"TWO"
    assert blobs.exists("a/1.bin") and not blobs.exists("a/nope")
    assert blobs.list() == ["a/1.bin", "b/2.bin", "b/sub/3.bin"]
    assert blobs.list("b/") == ["b/2.bin", "b/sub/3.bin"]
    assert blobs.list("b/s") == ["b/sub/3.bin"]  # plain string prefix, as on S3
    assert blobs.list("zzz/") == []
    assert blobs.uri("a/1.bin").startswith("file://") and blobs.uri("a/1.bin").endswith("/store/a/1.bin")
    blobs.delete("a/1.bin")
    assert not blobs.exists("a/1.bin")
    blobs.delete("a/1.bin", missing_ok=True)
    with pytest.raises(BlobNotFoundError):
        blobs.delete("a/1.bin")


def test_blobstore_missing_key_error_names_key_and_root(blobs):
    with pytest.raises(KeyError) as ei:
        blobs.get_bytes("rewards/nothing.parquet")
    msg = str(ei.value)
    assert "rewards/nothing.parquet" in msg and str(blobs.root) in msg


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "a/./b", "trail/", "a\\b", "a/.tmp-x"])
def test_blobstore_rejects_bad_keys(blobs, key):
    with pytest.raises(ValueError):
        blobs.put_bytes(key, b"x")


def test_atomic_write_leaves_no_partial_file(blobs, monkeypatch):
    blobs.put_bytes("d/obj", b"old")

    def boom(fd):
        raise OSError("disk died mid-write")

    monkeypatch.setattr(blobstore_mod.os, "fsync", boom)
    with pytest.raises(OSError, match="mid-write"):
        blobs.put_bytes("d/obj", b"new content that never lands")
    with pytest.raises(OSError):
        blobs.put_bytes("d/fresh", b"never")
    monkeypatch.undo()
    assert blobs.get_bytes("d/obj") == b"old"
    assert not blobs.exists("d/fresh")
    assert sorted(os.listdir(blobs.root / "d")) == ["obj"]  # no temporary file left behind
    assert blobs.list() == ["d/obj"]


def test_list_ignores_in_flight_temporary_files(blobs):
    blobs.put_bytes("x/a", b"1")
    (blobs.root / "x" / ".tmp-1234-a").write_bytes(b"partial")
    assert blobs.list("x/") == ["x/a"]


# ----------------------------------------------------------------------------- calls


def test_calls_round_trip_types_and_lists_exact(store):
    rows = make_trajectory("t1", 2, policy_version="v0") + make_trajectory("t2", 1, policy_version="v1", k=5)
    rows[1]["prompt_token_ids"] = []  # empty list must stay an empty list, not null
    rows[2]["task_id"] = None
    assert store.write_calls(rows) == ["v0", "v1"]
    assert store.versions()["calls"] == 1  # the table's creation, then one commit for both partitions
    table = store.read_calls()
    assert table.schema == CALL_SCHEMA
    got = {(r["trajectory_id"], r["call_index"]): r for r in table.to_pylist()}
    expected = pa.Table.from_pylist(rows, schema=CALL_SCHEMA).to_pylist()  # float32 rounding
    assert len(got) == 3
    for row in expected:
        assert got[(row["trajectory_id"], row["call_index"])] == row
    assert got[("t1", 1)]["prompt_token_ids"] == []
    assert len(got[("t2", 0)]["top_token_ids"][0]) == 5


def test_read_calls_filters_hive_partitions(store, blobs, monkeypatch):
    store.write_calls(make_trajectory("a", policy_version="v0"))
    store.write_calls(make_trajectory("b", policy_version="v1") + make_trajectory("c", policy_version="v2"))
    d = store.tables.dataset("calls")
    read = d.get_fragments(filter=ds.field("policy_version").isin(["v1"]))
    assert [f.path.split("/")[-2] for f in read] == ["policy_version=v1"]  # partition pruning: one file read
    t = store.read_calls(["v1"])
    assert set(t.column("trajectory_id").to_pylist()) == {"b"}
    assert set(t.column("policy_version").to_pylist()) == {"v1"}
    t = store.read_calls(["v0", "v2"])
    assert sorted(set(zip(t.column("trajectory_id").to_pylist(), t.column("policy_version").to_pylist()))) == [
        ("a", "v0"),
        ("c", "v2"),
    ]
    assert store.read_calls(["v9"]).num_rows == 0
    assert store.read_calls(["v9"]).schema == CALL_SCHEMA
    assert store.policy_versions() == ["v0", "v1", "v2"]


def test_policy_version_with_special_characters(store):
    store.write_calls([make_call("t", policy_version="ckpt/7 a=b%")])
    assert store.read_calls(["ckpt/7 a=b%"]).column("policy_version").to_pylist() == ["ckpt/7 a=b%"]
    assert store.read_calls().column("policy_version").to_pylist() == ["ckpt/7 a=b%"]


def test_dedupe_keeps_first_written_row(store):
    first = make_call("t", 0, output_text="first", created_at=T0 + timedelta(hours=1))
    second = make_call("t", 0, output_text="second", created_at=T0)
    store.write_calls([first])
    store.write_calls([second, make_call("t", 1)])
    t = store.read_calls()
    assert t.num_rows == 2
    by_index = {r["call_index"]: r for r in t.to_pylist()}
    assert by_index[0]["output_text"] == "first"
    raw = store.read_calls(dedupe=False)
    assert raw.num_rows == 3
    assert raw.column("output_text").to_pylist()[:2] == ["first", "second"]  # write order


def test_dedupe_within_one_write_and_across_partitions(store):
    store.write_calls([make_call("t", 0, output_text="a"), make_call("t", 0, output_text="b")])
    store.write_calls([make_call("t", 0, policy_version="v1", output_text="c")])
    assert store.read_calls().column("output_text").to_pylist() == ["a"]


def test_write_calls_casts_and_names_bad_column(store):
    table = pa.Table.from_pylist([make_call("t")])  # inferred types: int64, double, ...
    assert table.schema.field("call_index").type == pa.int64()
    store.write_calls(table)
    assert store.read_calls().schema == CALL_SCHEMA
    with pytest.raises(SchemaMismatchError, match="call_index"):
        store.write_calls([make_call("t") | {"call_index": "zero"}])
    with pytest.raises(SchemaMismatchError, match="output_token_ids"):
        store.write_calls([make_call("t", output_token_ids=[1.5, 2.0])])
    with pytest.raises(SchemaMismatchError, match="trajectory_id"):
        store.write_calls([{k: v for k, v in make_call("t").items() if k != "trajectory_id"}])
    with pytest.raises(SchemaMismatchError, match="policy_version"):
        store.write_calls([make_call("t", policy_version=None)])
    with pytest.raises(SchemaMismatchError, match="rewardd"):
        store.write_calls([make_call("t", rewardd=1.0)])
    assert store.write_calls([]) == []


def test_read_calls_column_projection(store):
    store.write_calls(make_trajectory("t", policy_version="v0"))
    t = store.read_calls(columns=["output_token_ids"])
    assert t.column_names == ["trajectory_id", "call_index", "policy_version", "output_token_ids"]


# ----------------------------------------------------------------------------- rewards


def test_latest_reward_wins(store):
    v1 = store.write_rewards([make_reward("a", 0.0, minutes=5), make_reward("b", 1.0, minutes=1)])
    assert v1 == store.versions()["rewards"]
    store.write_rewards([make_reward("a", 0.5, minutes=1)])  # written later but older: loses
    store.write_rewards([make_reward("b", 2.0, minutes=1)])  # same timestamp, written later: wins
    store.write_rewards([make_reward("c", 3.0, minutes=0), make_reward("c", 4.0, minutes=9)])
    r = store.read_rewards()
    assert r.schema == REWARD_SCHEMA
    assert dict(zip(r.column("trajectory_id").to_pylist(), r.column("reward").to_pylist())) == {
        "a": 0.0,
        "b": 2.0,
        "c": 4.0,
    }
    assert store.read_rewards(latest=False).num_rows == 6


def test_rewards_null_created_at_counts_as_oldest(store):
    store.write_rewards([make_reward("a", 1.0) | {"created_at": None}])
    store.write_rewards([make_reward("a", 2.0)])
    store.write_rewards([make_reward("a", 3.0) | {"created_at": None}])
    assert store.read_rewards().column("reward").to_pylist() == [2.0]


def test_empty_store_reads_empty_tables(store):
    assert store.read_calls().num_rows == 0
    assert store.read_rewards().schema == REWARD_SCHEMA
    assert store.used_trajectory_ids() == set()
    assert store.read_quarantine("r1").schema == QUARANTINE_SCHEMA


# ----------------------------------------------------------------------------- quarantine, ledger, json


def test_quarantine_round_trip_and_replace(store):
    rows = [make_call("t") | {"quarantine_reason": "empty_generation: call 0", "reward": math.nan}]
    table = pa.Table.from_pylist(rows)
    assert store.write_quarantine(table, "round-000001") == store.versions()["quarantine"]
    store.write_quarantine(table, "round-000001")
    assert store.read_quarantine("round-000001").num_rows == 2
    store.write_quarantine(table, "round-000001", replace=True)
    q = store.read_quarantine("round-000001")
    assert q.num_rows == 1 and q.schema == QUARANTINE_SCHEMA
    assert q.column("quarantine_reason").to_pylist() == ["empty_generation: call 0"]
    assert store.write_quarantine(table.slice(0, 0), "round-000001", replace=True) is None
    assert store.read_quarantine("round-000001").num_rows == 0


def test_ledger_idempotent_and_used_ids(store, blobs):
    store.write_ledger("round-000001", ["a", "b"], quarantined_ids=["x"])
    store.write_ledger("round-000001", ["a", "b"], quarantined_ids=["x"])  # re-materialised
    assert sorted(store.read_ledger("round-000001")["trajectory_id"].to_pylist()) == ["a", "b", "x"]
    store.write_ledger("round-000002", ["c"])
    assert store.used_trajectory_ids() == {"a", "b", "x", "c"}
    assert store.used_trajectory_ids(include_quarantined=False) == {"a", "b", "c"}
    assert store.used_trajectory_ids(exclude_round="round-000001") == {"c"}
    assert store.ledger_rounds() == ["round-000001", "round-000002"]
    store.write_ledger("round-000001", ["a"])  # overwrite replaces, not appends
    assert store.used_trajectory_ids(exclude_round="round-000002") == {"a"}


def test_json_documents(store):
    doc = {"round": "round-000003", "decision": "promote", "metrics": {"acc": 0.5, "n": 3, "loss": None}}
    documents.put_json(store.blobs, "rounds/round-000003/decision.json", doc)
    assert documents.get_json(store.blobs, "rounds/round-000003/decision.json") == doc
    with pytest.raises(KeyError, match="evals/none.json"):
        documents.get_json(store.blobs, "evals/none.json")


def test_uuid7_is_time_ordered():
    ids = [uuid7() for _ in range(2000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(i[14] == "7" for i in ids)


def test_json_documents_keep_nan(store):
    documents.put_json(store.blobs, "evals/e.json", {"loss": math.nan})
    assert math.isnan(documents.get_json(store.blobs, "evals/e.json")["loss"])
