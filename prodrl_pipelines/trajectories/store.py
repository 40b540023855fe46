"""The trajectory store: recorded calls, rewards, quarantine and the round ledger as Parquet blobs.

Layout under a ``BlobStore`` (identical on a local directory and on S3)::

    trajectories/policy_version=<v>/part-<uuid>.parquet   calls (CALL_SCHEMA minus policy_version)
    rewards/part-<uuid>.parquet                            rewards (REWARD_SCHEMA)
    quarantine/round=<round>/part-<uuid>.parquet           rejected rows (QUARANTINE_SCHEMA)
    ledger/round=<round>.parquet                           trajectories a round consumed
    <anything>.json                                        small JSON documents (put_json/get_json)

Parts are append-only. Part names are time-ordered UUIDs (version 7), so sorting part names gives
write order; read-time de-duplication keeps the first-written copy of a call and the latest reward.
Partition values are percent-encoded in keys, so any policy version or round key is safe.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote, unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .blobstore import BlobStore
from .schema import CALL_SCHEMA, QUARANTINE_SCHEMA, REWARD_SCHEMA

CALLS_PREFIX = "trajectories/"
REWARDS_PREFIX = "rewards/"
QUARANTINE_PREFIX = "quarantine/"
LEDGER_PREFIX = "ledger/"
RETRACTED_PREFIX = "retracted/"

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

# Calls are stored without their partition column; it comes back from the key.
_CALL_FILE_SCHEMA = pa.schema([f for f in CALL_SCHEMA if f.name != "policy_version"])


class SchemaMismatchError(ValueError):
    """Input rows cannot be brought to the data contract; the message names the column."""


# ----------------------------------------------------------------------------- conversion helpers


def to_table(rows: Sequence[dict[str, Any]] | pa.Table, schema: pa.Schema, what: str = "rows") -> pa.Table:
    """Bring ``rows`` (list of dicts or a table) to exactly ``schema``: same columns, order and types.

    Missing nullable columns become nulls; a missing non-nullable column, a null in a non-nullable
    column, an unknown column or a value that cannot be cast raises ``SchemaMismatchError`` naming
    the column.
    """
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    if isinstance(rows, pa.Table):
        present = set(rows.column_names)
        n = rows.num_rows
    else:
        rows = list(rows)
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise SchemaMismatchError(f"{what}: row {i} is a {type(r).__name__}, expected a dict")
        present = set().union(*(r.keys() for r in rows)) if rows else set()
        n = len(rows)
    unknown = sorted(present - set(schema.names))
    if unknown:
        raise SchemaMismatchError(
            f"{what}: unknown column(s) {unknown}; the contract's columns are {schema.names}"
        )
    arrays = []
    for field in schema:
        if field.name not in present:
            if not field.nullable and n > 0:
                raise SchemaMismatchError(f"{what}: required column {field.name!r} is missing")
            arrays.append(pa.nulls(n, field.type))
            continue
        if isinstance(rows, pa.Table):
            arr = _cast_column(rows.column(field.name), field, what)
        else:
            arr = _array_from_values([r.get(field.name) for r in rows], field, what)
        if not field.nullable and arr.null_count:
            first = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise SchemaMismatchError(
                f"{what}: column {field.name!r} must not be null (row {first} is null)"
            )
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=schema)


def _cast_column(col: pa.ChunkedArray, field: pa.Field, what: str) -> pa.ChunkedArray:
    if col.type == field.type:
        return col
    try:
        return col.cast(field.type)  # safe cast: overflow / truncation raise
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaMismatchError(
            f"{what}: column {field.name!r} of type {col.type} cannot be cast to {field.type}: {e}"
        ) from None


def _has_integer(t: pa.DataType) -> bool:
    while pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return pa.types.is_integer(t)


def _array_from_values(values: list[Any], field: pa.Field, what: str) -> pa.Array:
    if _has_integer(field.type):
        # pa.array(..., type=int32) silently truncates 1.5 -> 1; infer, then cast safely instead.
        try:
            inferred = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            inferred = None
        if inferred is not None:
            try:
                return inferred.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                raise SchemaMismatchError(
                    f"{what}: column {field.name!r} cannot be converted to {field.type}: {e}"
                ) from None
    try:
        return pa.array(values, type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError,
            OverflowError) as e:  # ValueError includes a string with no UTF-8 form
        first_error = e
    try:  # e.g. ISO strings for a timestamp: infer, then cast safely
        return pa.array(values).cast(field.type)
    except Exception:
        pass
    raise SchemaMismatchError(
        f"{what}: column {field.name!r} cannot be converted to {field.type}: {first_error}"
    ) from None


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Reorder / cast ``table`` to ``schema``, filling absent columns with nulls (for reading old parts)."""
    arrays = []
    for field in schema:
        if field.name in table.column_names:
            arrays.append(table.column(field.name).cast(field.type))
        else:
            arrays.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def latest_rewards(rewards: pa.Table) -> pa.Table:
    """One reward row per trajectory: the newest ``created_at`` wins; ties and nulls go to table order.

    Rows with a null ``created_at`` count as older than any timestamped row. Among equal timestamps the
    row later in the table (later written, when read from the store) wins.
    """
    n = rewards.num_rows
    if n == 0:
        return rewards
    codes = _codes(rewards.column("trajectory_id"))
    ts = rewards.column("created_at").cast(pa.int64())
    ts_np = pc.fill_null(ts, np.iinfo(np.int64).min).to_numpy()
    order = np.lexsort((np.arange(n), ts_np, codes))  # by trajectory, then time, then position
    sorted_codes = codes[order]
    last = np.ones(n, dtype=bool)
    last[:-1] = sorted_codes[1:] != sorted_codes[:-1]
    keep = np.sort(order[last])
    return rewards.take(pa.array(keep))


def _without_retracted(calls: pa.Table, retractions: pa.Table) -> pa.Table:
    """``calls`` minus the rows whose (trajectory_id, call_index, created_at) is retracted."""
    gone = set(zip(retractions.column("trajectory_id").to_pylist(), retractions.column("call_index").to_pylist(),
                   retractions.column("created_at").cast(pa.int64()).to_pylist()))
    candidates = np.flatnonzero(pc.is_in(calls.column("trajectory_id"),
                                         value_set=pa.array({g[0] for g in gone}, pa.string())).to_numpy(zero_copy_only=False))
    if len(candidates) == 0:
        return calls
    sub = calls.take(pa.array(candidates))
    hit = [k in gone for k in zip(sub.column("trajectory_id").to_pylist(), sub.column("call_index").to_pylist(),
                                  sub.column("created_at").cast(pa.int64()).to_pylist())]
    drop = candidates[np.asarray(hit, dtype=bool)]
    if len(drop) == 0:
        return calls
    keep = np.ones(calls.num_rows, dtype=bool)
    keep[drop] = False
    return calls.filter(pa.array(keep))


def first_calls(calls: pa.Table) -> pa.Table:
    """Drop repeated (trajectory_id, call_index) rows, keeping the first in table order."""
    if calls.num_rows == 0:
        return calls
    keys = _call_keys(calls)
    _, first = np.unique(keys, return_index=True)
    if len(first) == calls.num_rows:
        return calls
    return calls.take(pa.array(np.sort(first)))


def _codes(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Dense int64 codes of a string column (same string -> same code)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    enc = pc.dictionary_encode(col)
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _call_keys(calls: pa.Table) -> np.ndarray:
    """One int64 per (trajectory_id, call_index) pair."""
    t = _codes(calls.column("trajectory_id"))
    ci = calls.column("call_index").cast(pa.int64()).to_numpy().astype(np.int64)
    return (t << 32) | (ci & 0xFFFFFFFF)


# ----------------------------------------------------------------------------- time-ordered ids

_uuid_lock = threading.Lock()
_uuid_state = {"ms": -1, "seq": 0}


def uuid7() -> str:
    """A version-7 UUID: 48-bit millisecond timestamp + 12-bit in-process sequence + 62 random bits.

    String order equals creation order within a process (and across processes to the millisecond).
    """
    ms = time.time_ns() // 1_000_000
    with _uuid_lock:
        if ms <= _uuid_state["ms"]:
            ms = _uuid_state["ms"]
            seq = _uuid_state["seq"] + 1
            if seq > 0xFFF:
                ms, seq = ms + 1, 0
        else:
            seq = int.from_bytes(os.urandom(2), "big") & 0x3FF  # leave room to count up
        _uuid_state["ms"], _uuid_state["seq"] = ms, seq
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | seq << 64 | 0b10 << 62 | rand
    return str(uuid.UUID(int=value))


def _part_name() -> str:
    return f"part-{uuid7()}.parquet"


# A name that becomes a path segment (``policy_version=<name>``) stays well inside the 255-byte file
# name limit of local file systems and S3 keys once URL-encoded.
MAX_NAME_BYTES = 200


def name_problem(value, what: str) -> str | None:
    """Why ``value`` cannot name a partition of the store (None: it can). The one rule for every name
    that becomes a path: the recorder checks client headers with it before accepting a call."""
    if not isinstance(value, str) or not value:
        return f"{what} must be a non-empty string, got {value!r}"
    n = len(quote(value, safe=""))
    if n > MAX_NAME_BYTES:
        return (f"{what} is {n} bytes once URL-encoded, at most {MAX_NAME_BYTES}: it names a directory "
                f"of the trajectory store")
    return None


def _enc(value: str, what: str) -> str:
    problem = name_problem(value, what)
    if problem:
        raise SchemaMismatchError(problem)
    return quote(value, safe="")


def _dec(segment: str) -> str:
    return unquote(segment)


def _part_order(key: str) -> str:
    """Sort key giving write order across partitions: the part's file name (a time-ordered UUID)."""
    return key.rsplit("/", 1)[-1]


# ----------------------------------------------------------------------------- the store


class TrajectoryStore:
    """Recorded calls, rewards, quarantine, the round ledger and small JSON documents on a BlobStore."""

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs

    def __repr__(self) -> str:
        return f"TrajectoryStore({self.blobs!r})"

    # --- parquet I/O -------------------------------------------------------------------------

    def _put_table(self, key: str, table: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        self.blobs.put_bytes(key, sink.getvalue().to_pybytes())

    def _get_table(self, key: str, columns: Sequence[str] | None = None) -> pa.Table:
        data = self.blobs.get_bytes(key)
        reader = pq.ParquetFile(pa.BufferReader(data))
        if columns is not None:
            present = set(reader.schema_arrow.names)
            columns = [c for c in columns if c in present]
        return reader.read(columns=columns)

    # --- calls -------------------------------------------------------------------------------

    def write_calls(self, rows: Sequence[dict[str, Any]] | pa.Table) -> list[str]:
        """Validate types against CALL_SCHEMA and append one Parquet part per policy version.

        Returns the keys written (``trajectories/policy_version=<v>/part-<uuid7>.parquet``), in
        order of first appearance of each version. Raises ``SchemaMismatchError`` naming the column
        when a value cannot be cast. Content (token ranges, finiteness...) is not checked here: bad
        records are stored and quarantined at selection time.
        """
        table = to_table(rows, CALL_SCHEMA, "write_calls")
        if table.num_rows == 0:
            return []
        versions = table.column("policy_version").combine_chunks()
        enc = pc.dictionary_encode(versions)
        codes = enc.indices.to_numpy(zero_copy_only=False)
        dirs = [_enc(v, "policy_version") for v in enc.dictionary.to_pylist()]  # every name checked before any write
        keys = []
        body = table.drop_columns(["policy_version"])
        for code, name in enumerate(dirs):
            idx = np.flatnonzero(codes == code)
            part = body if len(idx) == table.num_rows else body.take(pa.array(idx))
            key = f"{CALLS_PREFIX}policy_version={name}/{_part_name()}"
            self._put_table(key, part)
            keys.append(key)
        return keys

    def policy_versions(self) -> list[str]:
        """Policy versions that have at least one stored part (sorted by string)."""
        seen = set()
        for key in self.blobs.list(CALLS_PREFIX + "policy_version="):
            seen.add(_dec(key[len(CALLS_PREFIX) :].split("/", 1)[0].split("=", 1)[1]))
        return sorted(seen)

    def _call_part_keys(self, policy_versions: Iterable[str] | None) -> list[tuple[str, str]]:
        """(key, policy_version) of call parts, in write order."""
        out = []
        if policy_versions is None:
            for key in self.blobs.list(CALLS_PREFIX + "policy_version="):
                segment = key[len(CALLS_PREFIX) :].split("/", 1)[0]
                out.append((key, _dec(segment.split("=", 1)[1])))
        else:
            for v in dict.fromkeys(policy_versions):  # unique, order kept
                prefix = f"{CALLS_PREFIX}policy_version={_enc(v, 'policy_version')}/"
                out.extend((key, v) for key in self.blobs.list(prefix))
        out.sort(key=lambda kv: _part_order(kv[0]))
        return out

    def read_calls(
        self,
        policy_versions: Sequence[str] | None = None,
        *,
        dedupe: bool = True,
        columns: Sequence[str] | None = None,
        retracted: bool = False,
    ) -> pa.Table:
        """Calls of the given policy versions (all when ``None``) as a CALL_SCHEMA table.

        Only the partitions asked for are listed and read. ``policy_version`` comes from the
        partition key. Rows are in write order; with ``dedupe`` (default) a repeated
        (trajectory_id, call_index) keeps its first-written row -- de-duplication only sees the
        partitions read. ``dedupe=False`` returns every stored copy (validation then quarantines the
        extra copies). ``columns`` restricts the columns read (the key columns and policy_version are
        always included); the result then has those columns in CALL_SCHEMA order. Rows retracted
        (``retract_calls``: superseded by a retry of the same call) are left out unless ``retracted``.
        """
        if isinstance(policy_versions, str):
            policy_versions = [policy_versions]
        schema = CALL_SCHEMA
        retractions = None if retracted else self.read_retractions()
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
        file_columns = [n for n in schema.names if n != "policy_version"]
        tables = []
        for key, version in self._call_part_keys(policy_versions):
            t = self._get_table(key, file_columns)
            if "policy_version" in t.column_names:
                t = t.drop_columns(["policy_version"])
            t = t.append_column(
                pa.field("policy_version", pa.string()), pa.array([version] * t.num_rows, pa.string())
            )
            tables.append(conform(t, schema))
        if not tables:
            return schema.empty_table()
        table = pa.concat_tables(tables).combine_chunks()
        if retractions is not None:
            table = _without_retracted(table, retractions)
            if columns is not None and "created_at" not in columns:
                table = table.drop_columns(["created_at"])
        return first_calls(table) if dedupe else table

    def retract_calls(self, rows: Sequence[dict[str, Any]]) -> str | None:
        """Record that the calls identified by (trajectory_id, call_index, created_at) are superseded:
        an append-only ``retracted/part-<uuid7>.parquet`` part (``None`` for no rows)."""
        return self._append_part(RETRACTED_PREFIX, rows, RETRACTION_SCHEMA, "retract_calls")

    def read_retractions(self) -> pa.Table:
        return self._read_parts(RETRACTED_PREFIX, RETRACTION_SCHEMA)

    def _append_part(self, prefix: str, rows, schema: pa.Schema, what: str) -> str | None:
        """Append ``rows`` as one ``<prefix>part-<uuid7>.parquet``; its key, or None for no rows."""
        table = to_table(rows, schema, what)
        if table.num_rows == 0:
            return None
        key = f"{prefix}{_part_name()}"
        self._put_table(key, table)
        return key

    def _read_parts(self, prefix: str, schema: pa.Schema) -> pa.Table:
        """Every part under ``prefix``, in write order, as one ``schema`` table."""
        keys = sorted(self.blobs.list(prefix), key=_part_order)
        tables = [conform(self._get_table(k), schema) for k in keys]
        return pa.concat_tables(tables).combine_chunks() if tables else schema.empty_table()

    # --- rewards -----------------------------------------------------------------------------

    def write_rewards(self, rows: Sequence[dict[str, Any]] | pa.Table) -> str | None:
        """Append a ``rewards/part-<uuid7>.parquet`` part; returns its key (``None`` for no rows)."""
        return self._append_part(REWARDS_PREFIX, rows, REWARD_SCHEMA, "write_rewards")

    def read_rewards(self, *, latest: bool = True) -> pa.Table:
        """All rewards (REWARD_SCHEMA); with ``latest`` one row per trajectory (see ``latest_rewards``)."""
        table = self._read_parts(REWARDS_PREFIX, REWARD_SCHEMA)
        return latest_rewards(table) if latest and table.num_rows else table

    # --- quarantine --------------------------------------------------------------------------

    def _quarantine_prefix(self, round_key: str) -> str:
        return f"{QUARANTINE_PREFIX}round={_enc(round_key, 'round_key')}/"

    def write_quarantine(self, table: pa.Table, round_key: str, *, replace: bool = False) -> str | None:
        """Append quarantined rows (QUARANTINE_SCHEMA) for a round; ``None`` when there are none.

        With ``replace`` the round's earlier parts are deleted first (idempotent re-materialisation).
        """
        table = to_table(table, QUARANTINE_SCHEMA, "write_quarantine")
        prefix = self._quarantine_prefix(round_key)
        if replace:
            for key in self.blobs.list(prefix):
                self.blobs.delete(key, missing_ok=True)
        if table.num_rows == 0:
            return None
        key = prefix + _part_name()
        self._put_table(key, table)
        return key

    def read_quarantine(self, round_key: str | None = None) -> pa.Table:
        """Quarantined rows of one round (all rounds when ``None``), QUARANTINE_SCHEMA."""
        prefix = QUARANTINE_PREFIX if round_key is None else self._quarantine_prefix(round_key)
        keys = sorted(self.blobs.list(prefix), key=_part_order)
        tables = [conform(self._get_table(k), QUARANTINE_SCHEMA) for k in keys]
        if not tables:
            return QUARANTINE_SCHEMA.empty_table()
        return pa.concat_tables(tables).combine_chunks()

    # --- round ledger ------------------------------------------------------------------------

    def _ledger_key(self, round_key: str) -> str:
        return f"{LEDGER_PREFIX}round={_enc(round_key, 'round_key')}.parquet"

    def write_ledger(
        self,
        round_key: str,
        trajectory_ids: Iterable[str],
        quarantined_ids: Iterable[str] = (),
    ) -> str:
        """Record the trajectories a round consumed: trained on (``trajectory_ids``) and rejected by
        its validation (``quarantined_ids``, so later rounds do not re-quarantine them).

        Overwrites the round's ledger, so re-materialising a round is idempotent.
        """
        trained = list(dict.fromkeys(trajectory_ids))
        trained_set = set(trained)
        rejected = [t for t in dict.fromkeys(quarantined_ids) if t not in trained_set]
        table = pa.table(
            {
                "trajectory_id": pa.array(trained + rejected, pa.string()),
                "status": pa.array(["trained"] * len(trained) + ["quarantined"] * len(rejected), pa.string()),
            },
            schema=LEDGER_SCHEMA,
        )
        key = self._ledger_key(round_key)
        self._put_table(key, table)
        return key

    def read_ledger(self, round_key: str) -> pa.Table:
        """The round's ledger (LEDGER_SCHEMA); raises ``BlobNotFoundError`` if it has none."""
        return conform(self._get_table(self._ledger_key(round_key)), LEDGER_SCHEMA)

    def ledger_rounds(self) -> list[str]:
        """Round keys that have a ledger."""
        out = []
        for key in self.blobs.list(LEDGER_PREFIX + "round="):
            name = key[len(LEDGER_PREFIX) :]
            if "/" not in name and name.endswith(".parquet"):
                out.append(_dec(name[len("round=") : -len(".parquet")]))
        return out

    def used_trajectory_ids(self, exclude_round: str | None = None, *, include_quarantined: bool = True) -> set[str]:
        """Trajectory ids in any round's ledger except ``exclude_round``.

        By default this includes the trajectories rounds quarantined; ``include_quarantined=False``
        returns only those trained on.
        """
        used: set[str] = set()
        for round_key in self.ledger_rounds():
            if round_key == exclude_round:
                continue
            t = self.read_ledger(round_key)
            if not include_quarantined:
                t = t.filter(pc.equal(t.column("status"), "trained"))
            used.update(t.column("trajectory_id").to_pylist())
        return used

    # --- JSON documents ----------------------------------------------------------------------

    def put_json(self, key: str, obj: Any) -> None:
        """Store ``obj`` as UTF-8 JSON (sorted keys, indented) atomically under ``key``.

        Non-JSON values (datetimes, paths) are written with ``str``; NaN / inf are written as
        ``NaN`` / ``Infinity`` like Python's ``json`` (a NaN metric must not crash a round).
        """
        data = json.dumps(obj, indent=2, sort_keys=True, default=str)
        self.blobs.put_bytes(key, data.encode("utf-8"))

    def get_json(self, key: str) -> Any:
        """Load the JSON document under ``key``; raises ``BlobNotFoundError`` if absent."""
        return json.loads(self.blobs.get_bytes(key).decode("utf-8"))
