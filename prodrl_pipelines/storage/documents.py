"""Round documents: a JSON object or an Arrow table stored whole under one blob key.

The blob store makes each write atomic, so a reader sees the previous document or the new one,
never half of one. JSON keeps NaN / inf the way Python's ``json`` writes them (a NaN metric must not
crash a round) and writes values JSON lacks (datetimes, paths) with ``str``.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prodrl_pipelines.storage.blobstore import BlobStore


def put_json(blobs: BlobStore, key: str, obj: Any) -> None:
    """Store ``obj`` as UTF-8 JSON (sorted keys, indented) under ``key``."""
    blobs.put_bytes(key, json.dumps(obj, indent=2, sort_keys=True, default=str).encode("utf-8"))


def get_json(blobs: BlobStore, key: str) -> Any:
    """The JSON document under ``key``; ``BlobNotFoundError`` (a ``KeyError``) names a missing key."""
    return json.loads(blobs.get_bytes(key).decode("utf-8"))


def put_table(blobs: BlobStore, key: str, table: pa.Table) -> None:
    """Store ``table`` as one Parquet file under ``key``."""
    buf = io.BytesIO()
    pq.write_table(table, buf)
    blobs.put_bytes(key, buf.getvalue())


def get_table(blobs: BlobStore, key: str) -> pa.Table:
    """The Parquet table under ``key``; ``BlobNotFoundError`` names a missing key."""
    return pq.read_table(io.BytesIO(blobs.get_bytes(key)))
