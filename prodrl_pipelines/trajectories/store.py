"""The trajectory store: recorded calls, rewards, retractions, quarantine and the round ledger as
Delta Lake tables (``tables.DeltaTables``), plus small JSON documents, on one ``BlobStore``.

Tables (under ``tables/`` of the blob store; the columns are the data contract's, DESIGN.md s.3)::

    calls        CALL_SCHEMA, partitioned by policy_version
    rewards      REWARD_SCHEMA
    retractions  calls superseded by a client's retry (RETRACTION_SCHEMA)
    quarantine   QUARANTINE_SCHEMA + round, partitioned by round
    ledger       round, trajectory_id, status ("trained" | "quarantined"), partitioned by round

Every append is one atomic commit, safe from several recorders at once. Two bookkeeping columns
keep write order across files and compaction: ``_part`` (a time-ordered id per append) and ``_row``
(the row's place in it). Read-time de-duplication keeps the first-written copy of a call and the
latest reward. Every read can name a table version (``as_of``): a round pins what it read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from prodrl_pipelines.storage.blobstore import BlobNotFoundError, BlobStore
from prodrl_pipelines.trajectories.rows import (  # noqa: F401  (the store's public helpers, re-exported for its users)
    MAX_NAME_BYTES, SchemaMismatchError, conform, first_calls, latest_rewards, name_problem, to_table, uuid7,
    without_retracted,
)
from prodrl_pipelines.trajectories.schema import CALL_SCHEMA, QUARANTINE_SCHEMA, REWARD_SCHEMA
from prodrl_pipelines.trajectories.tables import LOG_DIR, TABLES_PREFIX, DeltaTables

CALLS, REWARDS, RETRACTIONS, QUARANTINE, LEDGER = "calls", "rewards", "retractions", "quarantine", "ledger"
TABLE_NAMES = (CALLS, REWARDS, RETRACTIONS, QUARANTINE, LEDGER)

LEDGER_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        # "trained": in the round's dataset; "quarantined": rejected by the round's validation.
        pa.field("status", pa.string(), nullable=False),
    ]
)

# A stored call superseded by a later row of the same call id (a client's retry of the same call):
# read_calls leaves it out, so the retry's row is the call and nothing conflicts.
RETRACTION_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("call_index", pa.int32(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)

ORDER_COLUMNS = ("_part", "_row")
_ORDER_FIELDS = [pa.field("_part", pa.string(), nullable=False), pa.field("_row", pa.int32(), nullable=False)]
ROUND_FIELD = pa.field("round", pa.string(), nullable=False)

# Stored schemas: the contract's columns plus the bookkeeping ones.
STORED = {
    CALLS: pa.schema(list(CALL_SCHEMA) + _ORDER_FIELDS),
    REWARDS: pa.schema(list(REWARD_SCHEMA) + _ORDER_FIELDS),
    RETRACTIONS: pa.schema(list(RETRACTION_SCHEMA) + _ORDER_FIELDS),
    QUARANTINE: pa.schema([ROUND_FIELD] + list(QUARANTINE_SCHEMA) + _ORDER_FIELDS),
    LEDGER: pa.schema([ROUND_FIELD] + list(LEDGER_SCHEMA)),
}
# The ledger is not partitioned: every selection reads all of it (for its trajectories), and
# compaction can then fold all rounds' ledgers into one file.
PARTITION_BY = {CALLS: ["policy_version"], QUARANTINE: ["round"]}

TableVersions = Mapping[str, int]  # table name -> version, as a round pins them


def _stamped(table: pa.Table, name: str) -> pa.Table:
    """``table`` with this append's ``_part`` / ``_row`` columns, in the stored schema's order."""
    n = table.num_rows
    table = table.append_column(_ORDER_FIELDS[0], pa.array([uuid7()] * n, pa.string()))
    table = table.append_column(_ORDER_FIELDS[1], pa.array(range(n), pa.int32()))
    return table.select(STORED[name].names).cast(STORED[name])


def in_write_order(table: pa.Table) -> pa.Table:
    """Rows sorted by (``_part``, ``_row``): the order they were appended in, across files."""
    if table.num_rows <= 1 or "_part" not in table.column_names:
        return table
    return table.take(pc.sort_indices(table, [("_part", "ascending"), ("_row", "ascending")]))


def _row_filter(trajectory_ids: Sequence[str] | None, since) -> ds.Expression | None:
    """A scan filter: rows of ``trajectory_ids`` (all when None) created at or after ``since`` (a
    timestamp or microseconds since the epoch; all when None)."""
    filt = None
    if trajectory_ids is not None:
        filt = ds.field("trajectory_id").isin(pa.array(list(trajectory_ids), pa.string()))
    if since is not None:
        f = ds.field("created_at") >= pa.scalar(since, CALL_SCHEMA.field("created_at").type)
        filt = f if filt is None else filt & f
    return filt


def _partitions_since(dt, skip_versions: Sequence[str], since) -> list[str]:
    """Policy-version partitions of the snapshot ``dt``, but ``skip_versions``, that have a file
    whose ``created_at`` statistics reach ``since`` (or no statistics): from the log's file list, in
    memory. Naming them ("in") prunes far faster than "not in" a long history."""
    acts = pa.table(dt.get_add_actions(flatten=True))
    if acts.num_rows == 0 or "partition.policy_version" not in acts.column_names:
        return []
    pv = acts.column("partition.policy_version")
    keep = pc.invert(pc.is_in(pv, value_set=pa.array(list(skip_versions), pa.string())))
    if since is not None and "max.created_at" in acts.column_names:
        at = pa.scalar(since, CALL_SCHEMA.field("created_at").type).value
        newest = acts.column("max.created_at").cast(pa.int64())
        keep = pc.and_(keep, pc.or_kleene(pc.is_null(newest), pc.greater_equal(newest, at)))
    return sorted(set(pv.filter(keep).to_pylist()))


def _quote_sql(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class TrajectoryStore:
    """Recorded calls, rewards, quarantine, the round ledger and small JSON documents on a BlobStore."""

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs
        self.tables = DeltaTables(blobs)

    def __repr__(self) -> str:
        return f"TrajectoryStore({self.blobs!r})"

    def versions(self) -> dict[str, int]:
        """Each table's latest version (-1: not created yet): what a round pins."""
        return {name: self._latest_version(name) for name in TABLE_NAMES}

    def _latest_version(self, name: str) -> int:
        """The latest committed version from the log's listing (the checkpoint ``_last_checkpoint``
        names, then one LIST of the commits after it) rather than loading the latest snapshot: a
        scan loads the snapshot of the version pinned, once (``DeltaTables`` keeps it), and a table
        only pinned is never loaded. Without a checkpoint yet: the snapshot's version."""
        prefix = f"{TABLES_PREFIX}{name}/{LOG_DIR}"
        try:
            start = int(json.loads(self.blobs.get_bytes(prefix + "_last_checkpoint"))["version"])
        except (BlobNotFoundError, ValueError, KeyError, TypeError):
            return self.tables.version(name)
        keys = self.blobs.list(prefix, start_after=f"{prefix}{start:020d}")
        found = [int(k[len(prefix):-5]) for k in keys if k.endswith(".json") and k[len(prefix):-5].isdigit()]
        return max(found, default=start)

    def _scan(self, name: str, *, filter=None, columns: Sequence[str] | None = None,
              as_of: TableVersions | None = None, partitions: list | None = None) -> pa.Table:
        version = None if as_of is None else as_of.get(name)
        if version is not None and version < 0:
            return STORED[name].empty_table() if columns is None else STORED[name].empty_table().select(columns)
        return self.tables.scan(name, STORED[name], filter=filter, columns=columns, version=version,
                                partitions=partitions)

    def _append(self, name: str, table: pa.Table, txn: tuple[str, int] | None = None) -> int | None:
        if table.num_rows == 0:
            return None
        return self.tables.append(name, _stamped(table, name), PARTITION_BY.get(name, ()), txn=txn)

    # --- calls -------------------------------------------------------------------------------

    def write_calls(self, rows: Sequence[dict[str, Any]] | pa.Table, *, txn: tuple[str, int] | None = None) -> list[str]:
        """Validate types against CALL_SCHEMA and append them in one commit (partitioned by policy version).

        Returns the policy versions written, in order of first appearance. Raises
        ``SchemaMismatchError`` naming the column when a value cannot be cast, or naming a policy
        version that cannot name a partition. Content (token ranges, finiteness...) is not checked
        here: bad records are stored and quarantined at selection time. ``txn``: see ``DeltaTables.append``.
        """
        table = to_table(rows, CALL_SCHEMA, "write_calls")
        if table.num_rows == 0:
            return []
        versions = list(dict.fromkeys(table.column("policy_version").to_pylist()))
        for v in versions:  # every name checked before any write
            problem = name_problem(v, "policy_version")
            if problem:
                raise SchemaMismatchError(problem)
        self._append(CALLS, table, txn)
        return versions

    def policy_versions(self) -> list[str]:
        """Policy versions that have at least one stored call (sorted by string)."""
        dt = self.tables.open(CALLS)
        if dt is None:
            return []
        return sorted({p["policy_version"] for p in dt.partitions()})

    def read_calls(
        self,
        policy_versions: Sequence[str] | None = None,
        *,
        dedupe: bool = True,
        columns: Sequence[str] | None = None,
        retracted: bool = False,
        trajectory_ids: Sequence[str] | None = None,
        as_of: TableVersions | None = None,
    ) -> pa.Table:
        """Calls of the given policy versions (all when ``None``) as a CALL_SCHEMA table.

        Only the partitions asked for are read (partition pruning). Rows are in write order; with
        ``dedupe`` (default) a repeated (trajectory_id, call_index) keeps its first-written row --
        de-duplication only sees the partitions read. ``dedupe=False`` returns every stored copy
        (validation then quarantines the extra copies). ``columns`` restricts the columns read (the
        key columns and policy_version are always included); the result then has those columns in
        CALL_SCHEMA order. Rows retracted (``retract_calls``: superseded by a retry of the same call)
        are left out unless ``retracted``. ``trajectory_ids`` keeps those trajectories only;
        ``as_of`` reads the tables at pinned versions.
        """
        if isinstance(policy_versions, str):
            policy_versions = [policy_versions]
        schema = CALL_SCHEMA
        retractions = None if retracted else self.read_retractions(trajectory_ids=trajectory_ids, as_of=as_of)
        if retractions is not None and retractions.num_rows == 0:
            retractions = None
        if columns is not None:
            unknown = sorted(set(columns) - set(CALL_SCHEMA.names))
            if unknown:
                raise ValueError(f"read_calls: unknown column(s) {unknown}")
            wanted = set(columns) | {"trajectory_id", "call_index", "policy_version"}
            if retractions is not None:
                wanted.add("created_at")
            schema = pa.schema([f for f in CALL_SCHEMA if f.name in wanted])
        filt = parts = None
        if policy_versions is not None:
            parts = [("policy_version", "in", list(dict.fromkeys(policy_versions)))]
        if trajectory_ids is not None:
            filt = ds.field("trajectory_id").isin(pa.array(list(trajectory_ids), pa.string()))
        table = self._scan(CALLS, filter=filt, columns=schema.names + list(ORDER_COLUMNS), as_of=as_of,
                           partitions=parts)
        table = in_write_order(table).drop_columns(list(ORDER_COLUMNS))
        table = conform(table, schema).combine_chunks()
        if retractions is not None:
            table = without_retracted(table, retractions)
            if columns is not None and "created_at" not in columns:
                table = table.drop_columns(["created_at"])
        return first_calls(table) if dedupe else table

    def retract_calls(self, rows: Sequence[dict[str, Any]], *, txn: tuple[str, int] | None = None) -> int | None:
        """Record that the calls identified by (trajectory_id, call_index, created_at) are superseded
        (one append; returns the committed version, None for no rows)."""
        return self._append(RETRACTIONS, to_table(rows, RETRACTION_SCHEMA, "retract_calls"), txn)

    def read_retractions(self, *, trajectory_ids: Sequence[str] | None = None, since=None,
                         as_of: TableVersions | None = None) -> pa.Table:
        """Retractions (RETRACTION_SCHEMA) in write order; ``trajectory_ids`` and ``since`` (the
        retracted row's ``created_at`` at or after it) restrict the rows read (the filters go into
        the scan)."""
        t = in_write_order(self._scan(RETRACTIONS, filter=_row_filter(trajectory_ids, since), as_of=as_of))
        return conform(t, RETRACTION_SCHEMA)

    def read_call_keys(self, *, skip_versions: Sequence[str], since, trajectory_ids: Sequence[str] | None = None,
                       as_of: TableVersions | None = None) -> pa.Table:
        """(trajectory_id, call_index, policy_version, created_at) of the calls recorded at or after
        ``since`` (a timestamp) in every partition but ``skip_versions``, retracted rows included:
        what selection and the sensor read to see a trajectory's calls outside the policy window.
        The partitions skipped are never opened; the time and ``trajectory_ids`` filters go into
        the scan (row-group statistics)."""
        cols = ["trajectory_id", "call_index", "policy_version", "created_at"]
        schema = pa.schema([CALL_SCHEMA.field(c) for c in cols])
        version = None if as_of is None else as_of.get(CALLS)
        dt = None if version is not None and version < 0 else self.tables.open(CALLS, version)
        wanted = _partitions_since(dt, skip_versions, since) if dt is not None else []
        if not wanted:
            return schema.empty_table()
        t = self._scan(CALLS, filter=_row_filter(trajectory_ids, since), columns=cols,
                       as_of={CALLS: dt.version()}, partitions=[("policy_version", "in", wanted)])
        return conform(t, schema).combine_chunks()

    # --- rewards -----------------------------------------------------------------------------

    def write_rewards(self, rows: Sequence[dict[str, Any]] | pa.Table, *, txn: tuple[str, int] | None = None) -> int | None:
        """Append reward rows in one commit; returns the committed version (``None`` for no rows)."""
        return self._append(REWARDS, to_table(rows, REWARD_SCHEMA, "write_rewards"), txn)

    def read_rewards(self, *, latest: bool = True, trajectory_ids: Sequence[str] | None = None, since=None,
                     as_of: TableVersions | None = None) -> pa.Table:
        """Rewards (REWARD_SCHEMA) in write order; with ``latest`` one row per trajectory (see
        ``latest_rewards``); ``trajectory_ids`` and ``since`` (``created_at`` at or after it)
        restrict the rows read (statistics pruning)."""
        filt = _row_filter(trajectory_ids, since)
        table = conform(in_write_order(self._scan(REWARDS, filter=filt, as_of=as_of)), REWARD_SCHEMA)
        return latest_rewards(table) if latest and table.num_rows else table

    # --- quarantine --------------------------------------------------------------------------

    def write_quarantine(self, table: pa.Table, round_key: str, *, replace: bool = False) -> int | None:
        """Append quarantined rows (QUARANTINE_SCHEMA) for a round; ``None`` when there are none.

        With ``replace`` the round's earlier rows are replaced in the same commit (idempotent
        re-materialisation).
        """
        table = to_table(table, QUARANTINE_SCHEMA, "write_quarantine")
        problem = name_problem(round_key, "round_key")
        if problem:
            raise SchemaMismatchError(problem)
        rows = table.add_column(0, ROUND_FIELD, pa.array([round_key] * table.num_rows, pa.string()))
        if replace:
            if table.num_rows == 0 and self.read_quarantine(round_key).num_rows == 0:
                return None
            self.tables.replace_where(QUARANTINE, _stamped(rows, QUARANTINE), f"round = {_quote_sql(round_key)}",
                                      PARTITION_BY[QUARANTINE])
            return None if table.num_rows == 0 else self.tables.version(QUARANTINE)
        return self._append(QUARANTINE, rows)

    def read_quarantine(self, round_key: str | None = None) -> pa.Table:
        """Quarantined rows of one round (all rounds when ``None``), QUARANTINE_SCHEMA."""
        parts = None if round_key is None else [("round", "=", round_key)]
        return conform(in_write_order(self._scan(QUARANTINE, partitions=parts)), QUARANTINE_SCHEMA)

    # --- round ledger ------------------------------------------------------------------------

    def write_ledger(
        self,
        round_key: str,
        trajectory_ids: Iterable[str],
        quarantined_ids: Iterable[str] = (),
    ) -> int:
        """Record the trajectories a round consumed: trained on (``trajectory_ids``) and rejected by
        its validation (``quarantined_ids``, so later rounds do not re-quarantine them).

        Replaces the round's ledger in one commit, so re-materialising a round is idempotent.
        Returns the committed version.
        """
        problem = name_problem(round_key, "round_key")
        if problem:
            raise SchemaMismatchError(problem)
        trained = list(dict.fromkeys(trajectory_ids))
        trained_set = set(trained)
        rejected = [t for t in dict.fromkeys(quarantined_ids) if t not in trained_set]
        n = len(trained) + len(rejected)
        table = pa.table(
            {
                "round": pa.array([round_key] * n, pa.string()),
                "trajectory_id": pa.array(trained + rejected, pa.string()),
                "status": pa.array(["trained"] * len(trained) + ["quarantined"] * len(rejected), pa.string()),
            },
            schema=STORED[LEDGER],
        )
        return self.tables.replace_where(LEDGER, table, f"round = {_quote_sql(round_key)}")

    def read_ledger(self, round_key: str) -> pa.Table:
        """The round's ledger (LEDGER_SCHEMA); raises ``KeyError`` naming the round if it has none."""
        t = self._scan(LEDGER, filter=ds.field("round") == round_key)
        if t.num_rows == 0 and round_key not in self.ledger_rounds():
            raise KeyError(f"round {round_key!r} has no ledger in {self!r}")
        return conform(t, LEDGER_SCHEMA)

    def ledger_rounds(self) -> list[str]:
        """Round keys that have a ledger."""
        return sorted(set(self._scan(LEDGER, columns=["round"]).column("round").to_pylist()))

    def used_trajectory_ids(self, exclude_round: str | None = None, *, include_quarantined: bool = True,
                            trajectory_ids: Sequence[str] | None = None,
                            as_of: TableVersions | None = None) -> set[str]:
        """Trajectory ids in any round's ledger except ``exclude_round`` (only among ``trajectory_ids``
        when given: the filter is pushed into the scan).

        By default this includes the trajectories rounds quarantined; ``include_quarantined=False``
        returns only those trained on.
        """
        filt = None
        if exclude_round is not None:
            filt = ds.field("round") != exclude_round
        if not include_quarantined:
            f = ds.field("status") == "trained"
            filt = f if filt is None else filt & f
        if trajectory_ids is not None:
            f = ds.field("trajectory_id").isin(pa.array(list(trajectory_ids), pa.string()))
            filt = f if filt is None else filt & f
        t = self._scan(LEDGER, filter=filt, columns=["trajectory_id"], as_of=as_of)
        return set(t.column("trajectory_id").to_pylist())
