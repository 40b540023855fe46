"""Keeping the store's tables small and answering operators' questions about them.

* ``compact``: rewrite each table's small files into few large ones (``optimize.compact``, a commit
  that changes no row), checkpoint the log and drop expired log entries. Readers and the sensor see
  the same rows before and after; time travel to earlier versions keeps working until a vacuum.
* ``vacuum``: delete data files no version within the retention still references, but never one a
  round in flight pinned (the retention grows to cover the oldest pin). A decided round keeps its
  own dataset file in the round's documents, so its history stays readable after any vacuum.
* ``stats``: per policy version: calls, trajectories, rewarded, eligible (rewarded, not yet in a
  ledger), used (trained on), quarantined, files and bytes.
* ``query``: DuckDB SQL over the tables (``calls``, ``rewards``, ``retractions``, ``quarantine``,
  ``ledger``), scanned through Arrow with filter pushdown.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

import pyarrow as pa

from prodrl_pipelines.trajectories.store import PARTITION_BY, TABLE_NAMES, TrajectoryStore


def compact(store: TrajectoryStore, tables: Iterable[str] = TABLE_NAMES, target_size: int | None = None) -> dict:
    """Compact each table; per table: files before and after, and the new version."""
    out = {}
    for name in tables:
        dt = store.tables.open_for_update(name)  # compact() moves it to the new version: never a shared one
        if dt is None:
            continue
        before = len(dt.file_uris())
        metrics = dt.optimize.compact(target_size=target_size)
        dt = store.tables.open_for_update(name)
        if metrics.get("numFilesRemoved", 0):
            dt.create_checkpoint()  # readers start from it instead of replaying every small commit
            dt.cleanup_metadata()  # log entries older than the log retention
        out[name] = {"files_before": before, "files_after": len(dt.file_uris()), "version": dt.version(),
                     "files_removed": int(metrics.get("numFilesRemoved", 0)),
                     "files_added": int(metrics.get("numFilesAdded", 0))}
    return out


def commit_time_ms(store: TrajectoryStore, name: str, version: int) -> int | None:
    """When a table version was committed (its commitInfo), or None if its log entry is gone."""
    try:
        text = store.blobs.get_bytes(f"tables/{name}/_delta_log/{version:020d}.json").decode()
    except KeyError:
        return None
    for line in text.splitlines():
        if '"commitInfo"' in line:
            return json.loads(line)["commitInfo"].get("timestamp")
    return None


def vacuum(store: TrajectoryStore, retention_hours: float, pins: Iterable[dict] = (), dry_run: bool = False,
           now_ms: int | None = None) -> dict:
    """Delete files unreferenced for longer than ``retention_hours``, keeping every file a pinned
    snapshot in ``pins`` (table -> version, one per round in flight) still needs. Per table: the
    retention used and the files deleted (or that would be, with ``dry_run``)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    pins = list(pins)
    out = {}
    for name in TABLE_NAMES:
        dt = store.tables.open_for_update(name)  # vacuum commits through it
        if dt is None:
            continue
        hours = float(retention_hours)
        for pin in pins:
            v = pin.get(name)
            if v is None or v < 0:
                continue
            t = commit_time_ms(store, name, int(v))
            # files removed after the pinned commit are still needed by it: keep everything since then
            if t is not None:
                hours = max(hours, (now_ms - t) / 3_600_000 + 1)
        files = dt.vacuum(retention_hours=int(hours + 0.999), dry_run=dry_run, enforce_retention_duration=False)
        out[name] = {"retention_hours": int(hours + 0.999), "files_deleted": len(files)}
    return out


def _register(con, store: TrajectoryStore) -> list[str]:
    from prodrl_pipelines.trajectories.store import STORED

    names = []
    for name in TABLE_NAMES:
        d = store.tables.dataset(name)
        con.register(name, d if d is not None else STORED[name].empty_table())
        names.append(name)
    return names


def query(store: TrajectoryStore, sql: str) -> pa.Table:
    """Run DuckDB ``sql`` over the store's tables; the result as an Arrow table."""
    import duckdb

    con = duckdb.connect()
    try:
        _register(con, store)
        try:
            return con.sql(sql).to_arrow_table()
        except duckdb.Error as e:
            raise ValueError(f"query failed: {e} (tables: {', '.join(TABLE_NAMES)})") from None
    finally:
        con.close()


STATS_SQL = """
WITH c AS (SELECT policy_version, trajectory_id, count(*) AS n FROM calls GROUP BY ALL),
     r AS (SELECT DISTINCT trajectory_id FROM rewards WHERE reward IS NOT NULL AND isfinite(reward)),
     l AS (SELECT trajectory_id, max(status = 'trained') AS trained, max(status = 'quarantined') AS quarantined
           FROM ledger GROUP BY ALL)
SELECT c.policy_version,
       sum(c.n)::BIGINT AS calls,
       count(*)::BIGINT AS trajectories,
       count(r.trajectory_id)::BIGINT AS rewarded,
       count(*) FILTER (WHERE r.trajectory_id IS NOT NULL AND l.trajectory_id IS NULL)::BIGINT AS eligible,
       count(*) FILTER (WHERE l.trained)::BIGINT AS used,
       count(*) FILTER (WHERE l.quarantined AND NOT l.trained)::BIGINT AS quarantined
FROM c LEFT JOIN r USING (trajectory_id) LEFT JOIN l USING (trajectory_id)
GROUP BY c.policy_version ORDER BY c.policy_version
"""


def stats(store: TrajectoryStore) -> list[dict]:
    """One row per policy version (see the module docstring); ``eligible`` is an upper bound (the
    validation rules are not applied)."""
    rows = query(store, STATS_SQL).to_pylist()
    files: dict[str, list[int]] = {}
    dt = store.tables.open("calls")
    if dt is not None:
        actions = dt.get_add_actions(flatten=True)
        actions = pa.table(actions) if not isinstance(actions, pa.Table) else actions
        key = f"partition.{PARTITION_BY['calls'][0]}"
        for v, size in zip(actions.column(key).to_pylist(), actions.column("size_bytes").to_pylist()):
            f = files.setdefault(v, [0, 0])
            f[0] += 1
            f[1] += int(size)
    for r in rows:
        r["files"], r["bytes"] = files.get(r["policy_version"], [0, 0])
    return rows
