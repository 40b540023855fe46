"""The store's tables as Delta Lake tables (delta-rs) under a ``BlobStore``'s root.

A table named ``calls`` of a store on ``LocalBlobStore(root)`` lives at ``<root>/tables/calls``; on
``S3BlobStore(bucket, prefix)`` at ``s3://<bucket>/<prefix>/tables/calls``. DuckDB, Polars, Spark and
Trino read them as they are.

* Appends are atomic and safe from several processes: a commit is the conditional creation of
  ``_delta_log/<version>.json`` (rename-if-absent locally, ``If-None-Match`` on S3); a writer that
  loses the race re-reads the log and commits the next version.
* An append may carry an application transaction (``txn``: app id, version). ``txn_version`` reads
  it back, so a replaying writer skips what it already committed even if it crashed right after the
  commit (the recorder keys it by its WAL identity and segment number).
* ``log_since`` reads only the commits after a version, through the blob store's ``list(start_after)``
  and one GET per new commit: what a sensor tick costs does not depend on the table's history.
* Every snapshot is addressable (``version=``): a round pins the versions it read and re-reads them.
  The last few snapshots opened are kept (``MAX_OPEN_SNAPSHOTS``, least recently used dropped): each
  holds its table's file list, and a recorder opens two per append for as long as it runs. A cached
  snapshot is only read; maintenance (compaction, checkpoints, vacuum) mutates the ``DeltaTable`` it
  works on, so it gets its own from ``open_for_update``, never a cached one.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from prodrl_pipelines.storage.blobstore import BlobNotFoundError, BlobStore, LocalBlobStore

TABLES_PREFIX = "tables/"
LOG_DIR = "_delta_log/"
# Commits are kept this long for time travel and incremental readers; older ones are folded into
# checkpoints (every 100 commits) and cleaned up with vacuum.
TABLE_CONFIGURATION = {"delta.logRetentionDuration": "interval 30 days",
                       "delta.deletedFileRetentionDuration": "interval 7 days"}
MAX_OPEN_SNAPSHOTS = 8  # (table, version) snapshots kept open per process: a round's pins and the latest


class TableError(RuntimeError):
    """A store table cannot be read or written; the message names the table and its location."""


def _version_key(name: str, version: int) -> str:
    return f"{TABLES_PREFIX}{name}/{LOG_DIR}{version:020d}.json"


@dataclass
class Commit:
    """One commit of a table's log: the data files it added and removed (paths relative to the table).

    ``data_change`` is False for a rewrite that changes no row (compaction); readers of changes skip it.
    """

    version: int
    added: list[dict] = field(default_factory=list)  # {"path", "partitionValues", "size"}
    removed: list[str] = field(default_factory=list)
    data_change: bool = True
    operation: str = ""


class DeltaTables:
    """The store's named Delta tables on one blob store (local directory or S3 bucket prefix)."""

    def __init__(self, blobs: BlobStore, max_open: int = MAX_OPEN_SNAPSHOTS) -> None:
        self.blobs = blobs
        self.max_open = max(int(max_open), 0)
        # a version never changes: a recently opened one is reused (least recently used dropped)
        self._open: OrderedDict[tuple[str, int], object] = OrderedDict()
        self._open_lock = threading.Lock()  # the recorder's flusher and its readers share one store
        self._exists: set[str] = set()  # tables known to exist (a table is never dropped)

    def __repr__(self) -> str:
        return f"DeltaTables({self.blobs!r})"

    # --- location -----------------------------------------------------------------------------

    def uri(self, name: str) -> str:
        if isinstance(self.blobs, LocalBlobStore):
            return str(self.blobs.root / "tables" / name)
        bucket, prefix = self.blobs.bucket, self.blobs.prefix
        return f"s3://{bucket}/{prefix + '/' if prefix else ''}{TABLES_PREFIX}{name}"

    def storage_options(self) -> dict[str, str] | None:
        """delta-rs options for the blob store: its endpoint and region; credentials from the environment
        (the same default chain boto3 reads for the rest of the store)."""
        if isinstance(self.blobs, LocalBlobStore):
            return None
        opts: dict[str, str] = {"AWS_REGION": self.blobs.region or os.environ.get("AWS_DEFAULT_REGION", "us-east-1")}
        if self.blobs.endpoint_url:
            opts["AWS_ENDPOINT_URL"] = self.blobs.endpoint_url
            if self.blobs.endpoint_url.startswith("http://"):
                opts["AWS_ALLOW_HTTP"] = "true"
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            if os.environ.get(k):
                opts[k] = os.environ[k]
        return opts

    # --- snapshots ----------------------------------------------------------------------------

    def open(self, name: str, version: int | None = None):
        """The table's ``DeltaTable`` (at ``version``, else the latest) for reading; None when it does
        not exist yet. It may be shared with other readers: never call a method that commits on it
        (``open_for_update`` is for that)."""
        if version is not None:
            with self._open_lock:
                dt = self._open.get((name, version))
                if dt is not None:
                    self._open.move_to_end((name, version))
                    return dt
        dt = self._load(name, version)
        if dt is not None:
            self._keep(name, dt)
        return dt

    def open_for_update(self, name: str):
        """A ``DeltaTable`` of the latest version that no one else holds (None when the table does not
        exist): compaction, checkpoints and vacuum commit through it, which moves it to a new version."""
        return self._load(name, None)

    def _load(self, name: str, version: int | None):
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            dt = DeltaTable(self.uri(name), version=version, storage_options=self.storage_options())
        except TableNotFoundError:
            if version is not None:
                raise TableError(f"table {name!r} at {self.uri(name)} has no version {version}") from None
            return None
        except Exception as e:
            if version is not None and "version" in str(e).lower():
                raise TableError(f"table {name!r} at {self.uri(name)} cannot be read at version {version}: {e}") from e
            raise
        self._exists.add(name)
        return dt

    def _keep(self, name: str, dt) -> None:
        if self.max_open == 0:
            return
        key = (name, dt.version())
        with self._open_lock:
            self._open[key] = dt
            self._open.move_to_end(key)
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)

    def version(self, name: str) -> int:
        """The latest committed version; -1 when the table does not exist yet."""
        dt = self.open(name)
        return -1 if dt is None else dt.version()

    def ensure(self, name: str, schema: pa.Schema, partition_by: Sequence[str] = ()) -> None:
        """Create the table (empty) unless it exists; safe when several processes race to create it."""
        from deltalake import DeltaTable

        if name in self._exists or self.open(name) is not None:
            return
        try:
            DeltaTable.create(self.uri(name), schema, mode="ignore", partition_by=list(partition_by) or None,
                              configuration=TABLE_CONFIGURATION, storage_options=self.storage_options())
        except Exception:
            if self.open(name) is None:  # lost a race to another creator: the table is there all the same
                raise

    # --- writes -------------------------------------------------------------------------------

    def append(self, name: str, table: pa.Table, partition_by: Sequence[str] = (),
               txn: tuple[str, int] | None = None) -> int:
        """Append ``table`` in one commit (atomic); returns the committed version. With ``txn``
        (app id, version) the commit records it for ``txn_version``."""
        return self._write(name, table, "append", partition_by, txn=txn)

    def replace_where(self, name: str, table: pa.Table, predicate: str, partition_by: Sequence[str] = ()) -> int:
        """Atomically replace the rows matching ``predicate`` (a partition of the table) by ``table``."""
        return self._write(name, table, "overwrite", partition_by, predicate=predicate)

    def _write(self, name: str, table: pa.Table, mode: str, partition_by: Sequence[str], *,
               predicate: str | None = None, txn: tuple[str, int] | None = None) -> int:
        from deltalake import CommitProperties, Transaction, WriterProperties, write_deltalake

        self.ensure(name, table.schema, partition_by)
        props = CommitProperties(app_transactions=[Transaction(txn[0], int(txn[1]))]) if txn else None
        # appends evolve the table's schema when the contract gained an optional column since
        write_deltalake(self.uri(name), table, mode=mode, partition_by=list(partition_by) or None,
                        predicate=predicate, schema_mode="merge" if mode == "append" else None, storage_options=self.storage_options(), commit_properties=props,
                        writer_properties=WriterProperties(compression="ZSTD"))
        return self.version(name)

    def txn_version(self, name: str, app_id: str) -> int | None:
        """The last application-transaction version ``app_id`` committed to the table (None: never)."""
        dt = self.open(name)
        return None if dt is None else dt.transaction_version(app_id)

    # --- reads --------------------------------------------------------------------------------

    def dataset(self, name: str, version: int | None = None, partitions: list | None = None) -> ds.Dataset | None:
        """The snapshot as a pyarrow dataset; None when the table does not exist. ``partitions``
        (delta-rs filters, e.g. ``[("policy_version", "in", ["v1"])]``) leaves the other partitions'
        files out of the dataset altogether; filters on other columns use Parquet statistics."""
        dt = self.open(name, version)
        return None if dt is None else dt.to_pyarrow_dataset(partitions=partitions)

    def scan(self, name: str, schema: pa.Schema, *, filter: Any = None, columns: Sequence[str] | None = None,
             version: int | None = None, partitions: list | None = None) -> pa.Table:
        """Rows of the snapshot matching ``filter`` (a pyarrow expression) with ``columns``; an empty
        ``schema`` table when the table does not exist."""
        d = self.dataset(name, version, partitions)
        if d is None:
            return (schema if columns is None else pa.schema([schema.field(c) for c in columns])).empty_table()
        if columns is None:
            return d.to_table(filter=filter)
        # a column added to the contract after this table was written reads as nulls (``conform``)
        present = set(d.schema.names)
        return d.to_table(columns=[c for c in columns if c in present], filter=filter)

    def read_files(self, name: str, paths: Sequence[str], columns: Sequence[str] | None = None,
                   partition_values: Sequence[dict] | None = None) -> list[pa.Table]:
        """The given data files of the table (relative paths from its log), one table each, with the
        partition columns filled from ``partition_values``."""
        import pyarrow.parquet as pq

        out = []
        for i, path in enumerate(paths):
            data = self.blobs.get_bytes(f"{TABLES_PREFIX}{name}/{_unquote(path)}")
            pf = pq.ParquetFile(pa.BufferReader(data))
            cols = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
            t = pf.read(columns=cols)
            for k, v in (partition_values[i] if partition_values else {}).items():
                if (columns is None or k in columns) and k not in t.column_names:
                    t = t.append_column(k, pa.array([v] * t.num_rows, pa.string()))
            out.append(t)
        return out

    # --- the log ------------------------------------------------------------------------------

    def log_since(self, name: str, version: int) -> list[Commit] | None:
        """The commits after ``version``, oldest first: one LIST (from ``version``) and one GET per
        new commit. None when they cannot all be read (the log was cleaned up past ``version``):
        the caller then starts over from a snapshot."""
        prefix = f"{TABLES_PREFIX}{name}/{LOG_DIR}"
        after = _version_key(name, version) if version >= 0 else None
        keys = [k for k in self.blobs.list(prefix, start_after=after) if k.endswith(".json")
                and k[len(prefix):-5].isdigit()]
        commits = []
        expect = version + 1
        for key in keys:
            v = int(key[len(prefix):-5])
            if v != expect:
                return None
            try:
                text = self.blobs.get_bytes(key).decode("utf-8")
            except BlobNotFoundError:
                return None
            commits.append(_parse_commit(v, text))
            expect += 1
        return commits


def _unquote(path: str) -> str:
    from urllib.parse import unquote

    return unquote(path)


def _parse_commit(version: int, text: str) -> Commit:
    c = Commit(version)
    changes = False
    for line in text.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        if "add" in action:
            a = action["add"]
            c.added.append({"path": a["path"], "partitionValues": a.get("partitionValues") or {},
                            "size": a.get("size", 0)})
            changes = changes or bool(a.get("dataChange", True))
        elif "remove" in action:
            r = action["remove"]
            c.removed.append(r["path"])
            changes = changes or bool(r.get("dataChange", True))
        elif "commitInfo" in action:
            c.operation = action["commitInfo"].get("operation", "")
    c.data_change = changes or not (c.added or c.removed)
    return c
