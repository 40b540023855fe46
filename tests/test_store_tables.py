"""The store's Delta tables: incremental eligibility, pinned snapshots, compaction and vacuum,
migration from the part-file layout, concurrent writers, and `prodrl data`."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import T0, VOCAB, make_call, make_reward, make_trajectory

from prodrl_pipelines.trajectories import maintenance
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.eligibility import STATE_KEY, EligibilityTracker
from prodrl_pipelines.trajectories.migrate import migrate
from prodrl_pipelines.trajectories.rows import policy_window
from prodrl_pipelines.trajectories.selection import select_round_dataset
from prodrl_pipelines.trajectories.store import TrajectoryStore
from prodrl_pipelines.trajectories.tables import TableError
from prodrl_pipelines.trajectories.validation import validate_rows

ORDER = [f"v{i}" for i in range(8)]


@pytest.fixture
def store(tmp_path):
    return TrajectoryStore(LocalBlobStore(tmp_path / "store"))


def _full_count(store, live, lag):
    """The eligibility count from every row (the rules the tracker applies, without any state)."""
    window = policy_window(live, ORDER, lag)
    calls = store.read_calls(window, dedupe=False, columns=["output_token_ids", "output_logprobs", "temperature", "top_p",
                                                           "created_at"])
    if calls.num_rows == 0:
        return 0
    rewards = store.read_rewards()
    ids = calls.column("trajectory_id")
    used = store.used_trajectory_ids()
    include = (~np.isin(np.asarray(ids.to_pylist(), dtype=object), list(used))
               & np.isin(np.asarray(ids.to_pylist(), dtype=object), rewards.column("trajectory_id").to_pylist()))
    verdict = validate_rows(calls, rewards, VOCAB, set(ORDER), check_top=False, check_prompt=False, include=include)
    kept = set(np.unique(verdict.t[verdict.keep]).tolist())
    # a call outside the window that selection sees (crossing: recorded since the window's first
    # call, under a version other than the history's older ones, the predecessor included) holds
    # the trajectory back or quarantines it; either way it is not eligible
    everywhere = store.read_calls(None, dedupe=False, columns=["created_at"])
    start = ORDER.index(window[0])
    every_row = store.read_calls(None, dedupe=False, columns=["created_at"], retracted=True)
    first = min(a for a, v in zip(every_row["created_at"].to_pylist(), every_row["policy_version"].to_pylist())
                if v in window)
    outside = {t for t, v, a in zip(everywhere["trajectory_id"].to_pylist(), everywhere["policy_version"].to_pylist(),
                                    everywhere["created_at"].to_pylist())
               if v not in window and v not in ORDER[: max(start - 1, 0)] and a >= first}
    return len({verdict.traj_ids[t] for t in kept} - outside)


def test_incremental_count_matches_a_full_count_through_random_history(store):
    """Seeded random traffic over rounds: calls (some broken), rewards (some NaN, some late, some
    re-scored), retried calls, round ledgers and compactions, the window moving forward. After every
    step the incremental count equals a count from scratch and a count from every row."""
    rng = np.random.default_rng(11)
    tracker = EligibilityTracker(store, VOCAB)
    live, n = 1, 0
    for step in range(28):
        op = rng.choice(["calls", "calls", "rewards", "retry", "round", "compact"])
        v = ORDER[live]
        if op == "calls":
            rows, rewards = [], []
            for _ in range(int(rng.integers(1, 5))):
                tid = f"t{n}"
                n += 1
                traj = make_trajectory(tid, int(rng.integers(1, 4)), policy_version=v, minutes=n)
                if rng.random() < 0.2:
                    traj[-1]["output_logprobs"] = traj[-1]["output_logprobs"][:1] + [math.inf]
                if rng.random() < 0.15:
                    traj[0]["output_token_ids"] = [VOCAB + 3]
                if rng.random() < 0.1:
                    traj = traj[1:] or traj  # a gap in the call indices
                rows += traj
                if rng.random() < 0.7:
                    rewards.append(make_reward(tid, float(rng.choice([1.0, 0.0, math.nan])), minutes=n))
            store.write_calls(rows)
            store.write_rewards(rewards)
        elif op == "rewards" and n:
            tids = [f"t{i}" for i in rng.choice(n, size=min(n, 3), replace=False)]
            store.write_rewards([make_reward(t, float(rng.random()), minutes=1000 + step) for t in tids])
        elif op == "retry" and n:
            tid = f"t{int(rng.integers(n))}"
            old = store.read_calls(dedupe=False, trajectory_ids=[tid])
            if old.num_rows:
                row = old.slice(old.num_rows - 1).to_pylist()[0]
                store.retract_calls([{k: row[k] for k in ("trajectory_id", "call_index", "created_at")}])
                store.write_calls([{**row, "created_at": row["created_at"] + timedelta(seconds=30)}])
        elif op == "round":
            live = min(live + 1, len(ORDER) - 1)
            some = [f"t{i}" for i in rng.choice(max(n, 1), size=min(n, 2), replace=False)] if n else []
            store.write_ledger(f"round-{step:06d}", some[:1], some[1:])
        elif op == "compact":
            maintenance.compact(store)
        lag = int(rng.integers(0, 2))
        got = tracker.count(ORDER[live], ORDER, lag, report=True)
        expect = _full_count(store, ORDER[live], lag)
        assert got.eligible == expect, (step, op, got)
        fresh = EligibilityTracker(store, VOCAB)
        store.blobs.delete(STATE_KEY)
        assert fresh.count(ORDER[live], ORDER, lag) == expect
        assert tracker.count(ORDER[live], ORDER, lag) == expect  # from the rebuilt state


def test_a_tick_reads_what_arrived_not_the_history(store):
    """After 40 rounds of history a tick with nothing new reads no commit and no file; one new
    append costs one commit and one file whatever came before."""
    tracker = EligibilityTracker(store, VOCAB)
    for r in range(40):
        store.write_calls(make_trajectory(f"h{r}", 2, policy_version="v1", minutes=r))
        store.write_rewards([make_reward(f"h{r}")])
    first = tracker.count("v1", ORDER, 0, report=True)
    assert first.rebuilt == "first tick" and first.eligible == 40
    idle = tracker.count("v1", ORDER, 0, report=True)
    assert (idle.rebuilt, idle.commits_read, idle.files_read, idle.eligible) == (None, 0, 0, 40)
    store.write_calls(make_trajectory("new", 2, policy_version="v1"))
    one = tracker.count("v1", ORDER, 0, report=True)
    assert (one.rebuilt, one.commits_read, one.files_read, one.eligible) == (None, 1, 1, 40)  # no reward yet
    maintenance.compact(store)  # rewrites files, changes no row: skipped, not rebuilt
    after = tracker.count("v1", ORDER, 0, report=True)
    assert after.rebuilt is None and after.files_read == 0 and after.eligible == 40
    store.write_ledger("round-000001", ["h0", "h1"])
    assert tracker.count("v1", ORDER, 0) == 38
    store.write_ledger("round-000001", ["h0"])  # a round re-materialised: rows replaced -> rebuilt
    again = tracker.count("v1", ORDER, 0, report=True)
    assert again.rebuilt and "removed rows" in again.rebuilt and again.eligible == 39
    # a commit whose files a compaction replaced and a vacuum deleted before the tick: rebuilt, right
    store.write_calls(make_trajectory("gone", 2, policy_version="v1"))
    store.write_rewards([make_reward("gone"), make_reward("new")])
    maintenance.compact(store)
    maintenance.vacuum(store, 0)
    late = tracker.count("v1", ORDER, 0, report=True)
    assert late.rebuilt and "vacuumed" in late.rebuilt and late.eligible == 41


def test_a_round_reads_its_pinned_snapshot_after_compaction_and_new_traffic(store):
    for i in range(6):
        store.write_calls(make_trajectory(f"a{i}", 2, policy_version="v1", minutes=i))
        store.write_rewards([make_reward(f"a{i}", float(i))])
    first = select_round_dataset(store, "round-000001", "v1", ORDER, 0, 4, VOCAB)
    pinned = first.table_versions
    assert pinned["calls"] >= 6 and set(pinned) == {"calls", "rewards", "retractions", "quarantine", "ledger"}
    # after it: compaction, new (older-looking) traffic, re-scored rewards, another round
    maintenance.compact(store)
    store.write_calls(make_trajectory("late", 2, policy_version="v1", minutes=-100))
    store.write_rewards([make_reward("late", 9.0), make_reward("a0", -5.0, minutes=50)])
    store.write_ledger("round-000002", ["a4"])
    again = select_round_dataset(store, "round-000001", "v1", ORDER, 0, 4, VOCAB, as_of=pinned, record=False)
    assert again.dataset.equals(first.dataset) and again.trajectory_ids == first.trajectory_ids
    now = select_round_dataset(store, "round-000001", "v1", ORDER, 0, 4, VOCAB, record=False)
    assert now.trajectory_ids[0] == "late"  # the latest snapshot differs: the pin is what made it equal
    # vacuum keeps what a pin needs, and only that
    maintenance.vacuum(store, 0, pins=[pinned])
    assert select_round_dataset(store, "round-000001", "v1", ORDER, 0, 4, VOCAB, as_of=pinned,
                                record=False).dataset.equals(first.dataset)
    out = maintenance.vacuum(store, 0)
    assert out["calls"]["files_deleted"] > 0
    with pytest.raises((TableError, OSError)):  # a new reader: the pinned files are gone now
        TrajectoryStore(store.blobs).read_calls(["v1"], as_of=pinned)


def _legacy_part(blobs, key, rows, schema_drop=()):
    t = pa.Table.from_pylist(rows)
    t = t.drop_columns([c for c in schema_drop if c in t.column_names])
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink)
    blobs.put_bytes(key, sink.getvalue().to_pybytes())


def test_migrate_converts_the_part_layout_idempotently(store):
    blobs = store.blobs
    a, b = make_trajectory("a", 2, policy_version="v/1"), make_trajectory("b", 1, policy_version="v2")
    dup = make_call("a", 0, policy_version="v/1", output_text="second copy", created_at=T0 + timedelta(hours=1))
    _legacy_part(blobs, "trajectories/policy_version=v%2F1/part-0190a000-0000-7000-8000-000000000001.parquet",
                 a, ["policy_version"])
    _legacy_part(blobs, "trajectories/policy_version=v2/part-0190a000-0000-7000-8000-000000000002.parquet",
                 b, ["policy_version"])
    _legacy_part(blobs, "trajectories/policy_version=v%2F1/part-0190a000-0000-7000-8000-000000000003.parquet",
                 [dup], ["policy_version"])
    _legacy_part(blobs, "rewards/part-0190a000-0000-7000-8000-000000000004.parquet", [make_reward("a", 1.0)])
    _legacy_part(blobs, "rewards/part-0190a000-0000-7000-8000-000000000005.parquet", [make_reward("a", 2.0)])
    _legacy_part(blobs, "ledger/round=round-000001.parquet", [{"trajectory_id": "b", "status": "trained"}])
    assert store.read_calls().num_rows == 0  # not visible before the migration
    report = migrate(store)
    assert report["calls"] == {"legacy_parts": 3, "rows": 4, "migrated_now": 4, "already_migrated": False}
    assert report["rewards"]["rows"] == 2 and report["ledger"]["rows"] == 1
    calls = store.read_calls()
    assert calls.num_rows == 3  # the later copy of a#0 is de-duplicated: write order came from the part names
    assert [r["output_text"] for r in calls.to_pylist() if r["trajectory_id"] == "a" and r["call_index"] == 0] == ["o"]
    assert set(calls["policy_version"].to_pylist()) == {"v/1", "v2"}
    assert store.read_rewards()["reward"].to_pylist() == [2.0]  # same timestamp: the later part wins
    assert store.used_trajectory_ids() == {"b"}
    again = migrate(store)
    assert again["calls"]["already_migrated"] and again["calls"]["migrated_now"] == 0
    assert store.read_calls(dedupe=False).num_rows == 4  # nothing twice
    migrate(store, delete_legacy=True)
    assert blobs.list("trajectories/") == [] and store.read_calls(dedupe=False).num_rows == 4


def test_query_and_stats(store):
    store.write_calls(make_trajectory("a", 2, policy_version="v1") + make_trajectory("b", 3, policy_version="v2"))
    store.write_rewards([make_reward("a"), make_reward("b", math.nan)])
    store.write_ledger("round-000001", ["a"])
    rows = maintenance.stats(store)
    assert [(r["policy_version"], r["calls"], r["trajectories"], r["rewarded"], r["eligible"], r["used"])
            for r in rows] == [("v1", 2, 1, 1, 0, 1), ("v2", 3, 1, 0, 0, 0)]
    assert all(r["files"] == 1 and r["bytes"] > 0 for r in rows)
    t = maintenance.query(store, "SELECT trajectory_id, count(*) AS n FROM calls GROUP BY 1 ORDER BY 1")
    assert t.to_pylist() == [{"trajectory_id": "a", "n": 2}, {"trajectory_id": "b", "n": 3}]
    with pytest.raises(ValueError, match="nosuch"):
        maintenance.query(store, "SELECT * FROM nosuch")


def _append_many(root: str, writer: int, n: int) -> None:
    st = TrajectoryStore(LocalBlobStore(root))
    for k in range(n):
        st.write_calls(make_trajectory(f"w{writer}-{k}", 1, policy_version="v1"), txn=(f"writer-{writer}", k + 1))


def test_concurrent_appends_from_processes_all_land_once(tmp_path):
    """Three processes append at once: every commit lands exactly once, and each writer's
    application transaction says how far it got."""
    root = str(tmp_path / "store")
    TrajectoryStore(LocalBlobStore(root)).write_calls(make_trajectory("seed", 1, policy_version="v1"))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(root, w, 8)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)  # a ceiling: three fresh interpreters and their commit races, on a loaded machine
    assert [p.exitcode for p in procs] == [0, 0, 0]
    st = TrajectoryStore(LocalBlobStore(root))
    ids = st.read_calls(dedupe=False)["trajectory_id"].to_pylist()
    assert len(ids) == len(set(ids)) == 1 + 3 * 8
    assert [st.tables.txn_version("calls", f"writer-{w}") for w in range(3)] == [8, 8, 8]


def test_prodrl_data_cli(tmp_path, capsys, monkeypatch):
    from prodrl_pipelines.cli.main import main

    settings = tmp_path / "s.json"
    settings.write_text(json.dumps({"home": str(tmp_path / "home")}))
    st = TrajectoryStore(LocalBlobStore(tmp_path / "home" / "store"))
    st.write_calls(make_trajectory("a", 2, policy_version="v1"))
    assert main(["data", "stats", "--settings", str(settings), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["calls"] == 2
    assert main(["data", "query", "SELECT count(*) AS n FROM calls", "--settings", str(settings), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 2}]
    assert main(["data", "compact", "--settings", str(settings)]) == 0
    assert json.loads(capsys.readouterr().out)["calls"]["files_after"] == 1
    assert main(["data", "query", "SELEC nothing", "--settings", str(settings)]) == 1
    assert "query failed" in capsys.readouterr().err
