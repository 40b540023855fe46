"""Erasure on request, and retention by age: every row of the selected trajectories deleted from the
store's tables, the files that held them removed at once, and an audit row that holds no content.

Selectors (any of them; their union is erased, whole trajectories only):
- ``tenant``: the trajectories a tenant's recorder stored (``<tenant>/<id>``, ``recorder.tenants``;
  a single-token recorder stores ids without a prefix: erase those by id or by age);
- ``trajectory_ids``: as stored;
- ``before``: trajectories whose last call was recorded before that time (retention).

The tables with a ``trajectory_id`` column lose the rows (``ERASED_TABLES``: calls, rewards,
retractions, quarantine), each through a Delta delete (the files holding a selected row are rewritten
without it), then a vacuum with no retention: the old files go now, not after the retention of an
ordinary vacuum. Older snapshots of those tables cannot be read after that (their files are gone): a
round in flight whose pinned snapshot held erased rows fails when it reads it again, rather than
training on them. The ledger (which round consumed which trajectory, no content) keeps its rows: a
decided round's history is not rewritten; the rounds that trained on erased trajectories are
returned, for the caller to mark (``prodrl data erase`` tags their MLflow model versions).

Not erased here: calls still in a recorder's write-ahead log (flushed every few seconds: erase once
they are in the store) and the recorder's skipped-call markers (call indices and reasons, no content).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.trajectories.store import CALLS, LEDGER, QUARANTINE, RETRACTIONS, REWARDS, TrajectoryStore

ERASED_TABLES = (CALLS, REWARDS, RETRACTIONS, QUARANTINE)  # calls first (selected_ids)
AUDIT = "erasures"
AUDIT_SCHEMA = pa.schema([
    pa.field("erasure_id", pa.string(), nullable=False),
    pa.field("requested_at", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("selector", pa.string()),  # JSON: tenant, before, or the ids' count and digest (never the ids)
    pa.field("trajectories", pa.int64()),
    pa.field("rows_deleted", pa.string()),  # JSON: table -> rows
    pa.field("files_removed", pa.int64()),
    pa.field("rounds_trained", pa.list_(pa.string())),
    pa.field("requested_by", pa.string()),
    pa.field("reason", pa.string()),
])
IN_LIST = 500  # ids per delete predicate
COMMIT_TRIES = 8  # a delete that lost a race with a concurrent append (the recorder) is tried again


class ErasureError(ValueError):
    """The request cannot be carried out as given; the message says why."""


@dataclass
class Erasure:
    tenant: str | None = None
    trajectory_ids: list[str] = field(default_factory=list)
    before: datetime | None = None
    requested_by: str = ""
    reason: str = ""

    def check(self) -> None:
        if self.tenant is None and not self.trajectory_ids and self.before is None:
            raise ErasureError("nothing selected: give a tenant, trajectory ids or a date")
        if self.tenant is not None and (not self.tenant or "/" in self.tenant):
            raise ErasureError(f"tenant {self.tenant!r} is not a tenant name")
        if self.before is not None and self.before.tzinfo is None:
            raise ErasureError(f"before {self.before.isoformat()} has no time zone: give one (e.g. +00:00)")

    def selector(self) -> dict:
        out: dict = {}
        if self.tenant is not None:
            out["tenant"] = self.tenant
        if self.trajectory_ids:
            digest = hashlib.sha256("\n".join(sorted(set(self.trajectory_ids))).encode()).hexdigest()
            out["trajectory_ids"] = {"count": len(set(self.trajectory_ids)), "sha256": digest}
        if self.before is not None:
            out["before"] = self.before.isoformat()
        return out


def selected_ids(store: TrajectoryStore, req: Erasure) -> set[str]:
    """The stored trajectory ids ``req`` selects, among those any erased table holds."""
    req.check()
    calls = store._scan(CALLS, columns=["trajectory_id", "created_at"])  # read once: ids and, for age, times
    present: set[str] = set(calls.column("trajectory_id").to_pylist())
    for name in ERASED_TABLES[1:]:
        present.update(store._scan(name, columns=["trajectory_id"]).column("trajectory_id").to_pylist())
    out = {t for t in req.trajectory_ids if t in present}
    if req.tenant is not None:
        prefix = req.tenant + "/"
        out.update(t for t in present if t.startswith(prefix))
    if req.before is not None:
        if calls.num_rows:
            last = calls.group_by("trajectory_id").aggregate([("created_at", "max")])
            old = pc.less(last.column("created_at_max"), pa.scalar(req.before, type=pa.timestamp("us", tz="UTC")))
            out.update(last.filter(old).column("trajectory_id").to_pylist())
    return out


def _quoted(ids: list[str]) -> str:
    return ", ".join("'" + t.replace("'", "''") + "'" for t in ids)


def predicates(req: Erasure, ids: list[str]) -> list[str]:
    """Delete predicates covering ``ids``: a tenant's by its prefix (one pass over the table), the
    rest by id lists of at most ``IN_LIST``."""
    out, rest = [], ids
    if req.tenant is not None:
        prefix = req.tenant + "/"
        out.append(f"starts_with(trajectory_id, {_quoted([prefix])})")
        rest = [t for t in ids if not t.startswith(prefix)]
    return out + [f"trajectory_id IN ({_quoted(rest[i:i + IN_LIST])})" for i in range(0, len(rest), IN_LIST)]


def _delete(store: TrajectoryStore, name: str, preds: list[str]) -> int:
    """Delete the rows matching any of ``preds`` from table ``name``: the rows deleted."""
    deleted = 0
    for predicate in preds:
        for attempt in range(COMMIT_TRIES):
            dt = store.tables.open_for_update(name)
            if dt is None:
                return deleted
            try:
                deleted += int(dt.delete(predicate).get("num_deleted_rows", 0))
                break
            except Exception as e:  # noqa: BLE001 - delta-rs names a lost commit race only in its message
                lost_race = "conflict" in str(e).lower() or "commit" in str(e).lower()
                if attempt == COMMIT_TRIES - 1 or not lost_race:
                    raise
                time.sleep(0.05 * (attempt + 1))
    return deleted


def _vacuum_now(store: TrajectoryStore, name: str) -> int:
    dt = store.tables.open_for_update(name)
    if dt is None:
        return 0
    return len(dt.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False, full=True))


def rounds_trained_on(store: TrajectoryStore, ids: set[str]) -> list[str]:
    ledger = store._scan(LEDGER, columns=["round", "trajectory_id", "status"])
    if not ids or ledger.num_rows == 0:
        return []
    mask = pc.and_(pc.is_in(ledger.column("trajectory_id"), pa.array(sorted(ids))),
                   pc.equal(ledger.column("status"), "trained"))
    return sorted(set(ledger.filter(mask).column("round").to_pylist()))


def erase(store: TrajectoryStore, req: Erasure, *, dry_run: bool = False) -> dict:
    """Carry out ``req``: what was (with ``dry_run``: would be) erased, and its audit row's id."""
    ids = sorted(selected_ids(store, req))
    rounds = rounds_trained_on(store, set(ids))
    report = {"erasure_id": f"erasure-{uuid.uuid4().hex[:12]}", "selector": req.selector(),
              "trajectories": len(ids), "rounds_trained": rounds, "dry_run": dry_run}
    if dry_run:
        return report
    preds = predicates(req, ids)
    rows = {name: _delete(store, name, preds) for name in ERASED_TABLES} if ids else {}
    removed = sum(_vacuum_now(store, name) for name in ERASED_TABLES) if ids else 0
    report.update(rows_deleted=rows, files_removed=removed)
    store.tables.ensure(AUDIT, AUDIT_SCHEMA)
    store.tables.append(AUDIT, pa.Table.from_pylist([{
        "erasure_id": report["erasure_id"], "requested_at": datetime.now(timezone.utc),
        "selector": json.dumps(report["selector"], sort_keys=True), "trajectories": len(ids),
        "rows_deleted": json.dumps(rows, sort_keys=True), "files_removed": removed, "rounds_trained": rounds,
        "requested_by": req.requested_by, "reason": req.reason}], schema=AUDIT_SCHEMA))
    return report


def audit(store: TrajectoryStore) -> list[dict]:
    """Every erasure so far, oldest first (no content: selectors, counts, rounds)."""
    dt = store.tables.open(AUDIT)
    if dt is None:
        return []
    rows = dt.to_pyarrow_table().to_pylist()
    return sorted(rows, key=lambda r: r["requested_at"])
