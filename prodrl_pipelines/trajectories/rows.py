"""Rows to the data contract's Arrow tables, and the read-side rules every store reader shares.

``to_table`` brings dicts or tables to a schema exactly, naming the column that does not fit;
``latest_rewards`` and ``first_calls`` are the de-duplication rules (newest reward wins, first-written
call wins); ``uuid7`` gives time-ordered ids (write order); ``name_problem`` is the one rule for names
that become partition values.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


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


def without_retracted(calls: pa.Table, retractions: pa.Table) -> pa.Table:
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


def policy_window(live_version: str, version_order: list[str], max_policy_lag: int) -> list[str]:
    """The live version and the ``max_policy_lag`` versions before it in ``version_order`` (oldest first)."""
    if max_policy_lag < 0:
        raise ValueError(f"max_policy_lag must be >= 0, got {max_policy_lag}")
    try:
        i = list(version_order).index(live_version)
    except ValueError:
        raise ValueError(
            f"live policy version {live_version!r} is not in version_order {list(version_order)}"
        ) from None
    return list(version_order[max(0, i - max_policy_lag) : i + 1])
