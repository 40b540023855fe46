"""Erasure on request: a tenant's, some trajectories', or everything older than a date, gone from
every reader of the store (the store's own reads, DuckDB through ``prodrl data query``, every parquet
file left on disk, a snapshot pinned before the erasure); what others recorded stays; the audit row
holds no content; the rounds that trained on erased data are named and their history kept."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories import erasure, maintenance
from prodrl_pipelines.trajectories.erasure import Erasure, ErasureError
from prodrl_pipelines.trajectories.store import TrajectoryStore
from tests.helpers import T0, make_trajectory

SECRET = "alice-account-number-4242"


@pytest.fixture
def store(tmp_path):
    s = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    rows = []
    for tid, minutes in (("alice/a1", 0), ("alice/a2", 60), ("bob/b1", 0), ("bob/b2", 120), ("plain", 30)):
        rows += make_trajectory(tid, 2, minutes=minutes, prompt_text=f"{tid} {SECRET if tid.startswith('alice') else ''}")
    s.write_calls(rows)
    s.write_calls(make_trajectory("alice/a3", 1, minutes=5))  # a second commit: several files
    s.write_rewards([{"trajectory_id": t, "reward": 1.0, "source": "test", "created_at": T0}
                     for t in ("alice/a1", "alice/a2", "bob/b1", "bob/b2", "plain")])
    s.write_ledger("round-000001", ["alice/a1", "bob/b1"])
    s.write_ledger("round-000002", ["bob/b2"], quarantined_ids=["alice/a2"])
    return s


def _all_parquet_ids(root: Path) -> set[str]:
    """Every trajectory id in every parquet file on disk, referenced by a table's log or not (but the
    ledger's: the rounds' history of which ids they consumed, no content)."""
    out = set()
    for f in root.rglob("*.parquet"):
        if "tables/ledger" in str(f):
            continue
        t = pq.read_table(f)
        if "trajectory_id" in t.column_names:
            out.update(t.column("trajectory_id").to_pylist())
    return out


def test_a_tenants_data_is_gone_from_every_reader_and_the_rest_stays(store, tmp_path):
    pinned = store.tables.version("calls")
    report = erasure.erase(store, Erasure(tenant="alice", requested_by="dpo@example.com", reason="ticket 17"))
    assert report["trajectories"] == 3 and report["rounds_trained"] == ["round-000001"]
    assert report["rows_deleted"]["calls"] == 5 and report["rows_deleted"]["rewards"] == 2
    left = set(store.read_calls().column("trajectory_id").to_pylist())
    assert left == {"bob/b1", "bob/b2", "plain"}
    assert set(store.read_rewards().column("trajectory_id").to_pylist()) == {"bob/b1", "bob/b2", "plain"}
    duck = maintenance.query(store, "SELECT count(*) AS n FROM calls WHERE trajectory_id LIKE 'alice/%' "
                                    f"OR prompt_text LIKE '%{SECRET}%'").to_pylist()
    assert duck == [{"n": 0}]
    assert not {t for t in _all_parquet_ids(tmp_path / "store") if t.startswith("alice/")}
    with pytest.raises(Exception):  # the snapshot pinned before: its files are gone, nothing reads from it
        store.tables.open("calls", version=pinned).to_pyarrow_table()
    # the ledger keeps the decided rounds' history (ids, no content)
    assert "alice/a1" in store.read_ledger("round-000001").column("trajectory_id").to_pylist()
    (row,) = erasure.audit(store)
    assert json.loads(row["selector"]) == {"tenant": "alice"} and row["trajectories"] == 3
    assert row["requested_by"] == "dpo@example.com" and row["rounds_trained"] == ["round-000001"]
    assert SECRET not in json.dumps(row, default=str)


def test_ids_and_age_select_whole_trajectories_and_the_audit_names_no_id(store):
    dry = erasure.erase(store, Erasure(trajectory_ids=["bob/b1", "nobody"]), dry_run=True)
    assert dry["trajectories"] == 1 and store.read_calls().num_rows == 11 and erasure.audit(store) == []
    erasure.erase(store, Erasure(trajectory_ids=["bob/b1", "nobody"]))
    (row,) = erasure.audit(store)
    assert "bob/b1" not in json.dumps(row, default=str) and json.loads(row["selector"])["trajectory_ids"]["count"] == 2
    # retention: trajectories whose last call is older than T0 + 45 min (plain ended at 30:01, a3 at 5:00)
    report = erasure.erase(store, Erasure(before=T0 + timedelta(minutes=45)))
    assert report["trajectories"] == 3  # alice/a1, alice/a3, plain; alice/a2 (60 min) and bob/b2 stay
    assert set(store.read_calls().column("trajectory_id").to_pylist()) == {"alice/a2", "bob/b2"}


def test_bad_requests_fail_before_anything_is_erased(store):
    for bad, why in ((Erasure(), "nothing selected"), (Erasure(tenant="a/b"), "not a tenant name"),
                     (Erasure(before=datetime(2026, 1, 1)), "no time zone")):
        with pytest.raises(ErasureError, match=why):
            erasure.erase(store, bad)
    assert store.read_calls().num_rows == 11 and erasure.audit(store) == []
    assert erasure.erase(store, Erasure(tenant="carol"))["trajectories"] == 0  # recorded nothing: nothing to do
    assert datetime.now(timezone.utc) > T0


def test_prodrl_data_erase_marks_the_rounds_versions_and_retention_runs_in_the_maintenance_job(tmp_path, capsys):
    from dagster import materialize

    from prodrl_pipelines.assets.store_maintenance import store_compaction
    from prodrl_pipelines.cli.main import main
    from prodrl_pipelines.loop.data_erasure import ERASED_TAG
    from prodrl_pipelines.resources.settings import make_resources, open_services

    settings = {"home": str(tmp_path / "home")}
    res = make_resources(settings)
    svc = open_services(res["settings"], res["store"], res["mlflow"])
    svc.store.write_calls(make_trajectory("alice/a1", 2) + make_trajectory("bob/b1", 2, minutes=10))
    svc.store.write_ledger("round-000001", ["alice/a1"])
    svc.store.write_ledger("round-000002", ["bob/b1"])
    v1 = svc.lineage.register_candidate("file:///export/1", None, "round-000001", {"gate": "passed"})
    v2 = svc.lineage.register_candidate("file:///export/2", None, "round-000002", {"gate": "passed"})
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(settings))
    assert main(["data", "erase", "--settings", str(path), "--tenant", "alice", "--by", "dpo", "--reason", "request 9"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rounds_trained"] == ["round-000001"] and report["model_versions_marked"] == [v1]
    assert svc.lineage.version_tags(v1)[ERASED_TAG] == report["erasure_id"] and svc.lineage.version_tags(v1)["gate"] == "passed"
    assert ERASED_TAG not in svc.lineage.version_tags(v2)
    assert main(["data", "erase", "--settings", str(path), "--before", "2026-01-01"]) == 2  # no zone: refused
    assert "no time zone" in capsys.readouterr().err

    # retention: the hourly maintenance erases what data.retention_days no longer keeps (all of it, here)
    res = make_resources({**settings, "data_retention_days": 1})
    out = materialize([store_compaction], resources=res)
    assert out.success and svc.store.read_calls().num_rows == 0
    retention = out.asset_materializations_for_node("store_compaction")[0].metadata["retention"].value
    assert retention["trajectories"] == 1 and retention["model_versions_marked"] == [v2]
    assert [r["requested_by"] for r in erasure.audit(svc.store)] == ["dpo", "retention"]
