"""Where the deployment's endpoint record lives: a file under ``home`` (one host), or a row of a
PostgreSQL table that every host reads.

The record is written by the deploy step (a Dagster run worker), the canary sensor and the fleet
keeper, and read and written (a canary paused and resumed) by the recorder. With everything on one
host the file and its ``flock`` are enough. In the documented topology these run on different hosts
that share no disk, only the database and the object store: ``deploy.endpoint_store`` names a
PostgreSQL database and the record becomes the row ``endpoint_name`` of ``prodrl_endpoints``, changed
under its row lock (``SELECT ... FOR UPDATE``, the lock every host sees) and carrying a version that
followers poll instead of a file's inode and mtime.

A location is one string, so that it travels on a command line (``prodrl record --follow``) and to
a Ray actor: a path, or ``URL#NAME`` with a PostgreSQL URL (SQLAlchemy or libpq form): ``endpoint_location``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import Endpoint, EndpointFile

TABLE = "prodrl_endpoints"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PG = re.compile(r"^postgres(ql)?(\+\w+)?://")
_TABLES_MADE: set[tuple[str, str]] = set()  # (database, table) this process made: a record per write is opened anew


def ensure_table(conn, url: str, table: str, columns: str) -> None:
    """``CREATE TABLE IF NOT EXISTS`` once per process and database. It is not safe against itself (two
    first writers: a unique violation in the catalog), so the first writers take turns on an advisory lock."""
    if (url, table) in _TABLES_MADE:
        return
    with conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (table,))
        cur.execute(f"CREATE TABLE IF NOT EXISTS {table} ({columns})")
    conn.commit()
    _TABLES_MADE.add((url, table))


def is_database_url(value: str) -> bool:
    return bool(_PG.match(value or ""))


def check_endpoint_store(store: str, name: str) -> None:
    """A bad ``deploy.endpoint_store`` / ``deploy.endpoint_name`` fails naming the setting (before any work)."""
    if store and not is_database_url(store):
        raise ValueError(f"deploy.endpoint_store={store!r}: a PostgreSQL URL (postgresql://... or "
                         "postgresql+psycopg2://...), or empty for the file under home")
    if not NAME.match(name or ""):
        raise ValueError(f"deploy.endpoint_name={name!r}: letters, digits, '.', '_' and '-' (at most 128, "
                         "starting with a letter or digit)")


def open_endpoint(where: str | Path) -> EndpointFile:
    """The endpoint record at a location (``endpoint_location``): a file, or a PostgreSQL row."""
    where = str(where)
    if is_database_url(where):
        url, sep, name = where.rpartition("#")
        if not sep:
            raise ValueError(f"endpoint location {where!r}: a database location is URL#NAME")
        check_endpoint_store(url, name)
        return PostgresEndpoint(url, name)
    return EndpointFile(Path(where))


class PostgresEndpoint(EndpointFile):
    """The endpoint record as a row every host reads; ``EndpointFile``'s operations (``write``,
    ``update``, pausing and resuming a canary) hold the row's lock across the read and the write."""

    def __init__(self, url: str, name: str) -> None:
        from prodrl_pipelines.config.preflight import libpq_dsn

        self.url, self.name = url, name
        self.path = None  # no file: a location string names it (str(self))
        self._dsn = libpq_dsn(url)
        self._held = threading.local()  # the connection of the lock this thread holds

    def __str__(self) -> str:
        return f"{self.url}#{self.name}"

    def _connect(self):
        import psycopg2

        return psycopg2.connect(self._dsn, connect_timeout=10)

    def _ensure_table(self, conn) -> None:
        ensure_table(conn, self.url, TABLE, "name text PRIMARY KEY, body jsonb, version bigint NOT NULL DEFAULT 0, "
                     "updated_at timestamptz NOT NULL DEFAULT now()")

    @contextlib.contextmanager
    def locked(self):
        """The row's lock, for this transaction: writers on every host wait on one another; readers
        do not wait (they read the last committed record)."""
        if getattr(self._held, "conn", None) is not None:
            raise RuntimeError(f"endpoint {self.name}: the lock is already held by this thread")
        conn = self._connect()
        try:
            self._ensure_table(conn)
            with conn.cursor() as cur:
                cur.execute(f"INSERT INTO {TABLE} (name) VALUES (%s) ON CONFLICT (name) DO NOTHING", (self.name,))
                cur.execute(f"SELECT 1 FROM {TABLE} WHERE name = %s FOR UPDATE", (self.name,))
            self._held.conn = conn
            try:
                yield
            finally:
                self._held.conn = None
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            conn.close()

    def _query(self, sql: str, args: tuple):
        conn = getattr(self._held, "conn", None)
        if conn is not None:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return cur.fetchone()
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                try:
                    cur.execute(sql, args)
                except Exception as e:  # the table is made by the first writer
                    if getattr(e, "pgcode", None) == "42P01":  # undefined_table
                        return None
                    raise
                return cur.fetchone()
        finally:
            conn.close()

    def _write(self, ep: Endpoint) -> None:
        if getattr(self._held, "conn", None) is None:
            raise RuntimeError(f"endpoint {self.name}: written outside its lock")
        ep.switched_at = ep.switched_at or datetime.now(timezone.utc).isoformat()
        self._query(f"UPDATE {TABLE} SET body = %s, version = version + 1, updated_at = now() WHERE name = %s "
                    "RETURNING version", (json.dumps(asdict(ep)), self.name))

    def read(self) -> Endpoint | None:
        return self.read_versioned()[1]

    def read_versioned(self) -> tuple[int | None, Endpoint | None]:
        """The record and its version, bumped by every write (None: never written), in one query."""
        row = self._query(f"SELECT version, body FROM {TABLE} WHERE name = %s", (self.name,))
        raw = row[1] if row else None
        ep = Endpoint(**{k: v for k, v in raw.items() if k in Endpoint.__dataclass_fields__}) if raw else None
        return (int(row[0]) if row else None), ep


def endpoint_file(home: str | os.PathLike, deploy=None) -> EndpointFile:
    """The deployment's endpoint record: the file under ``home``, or the PostgreSQL row that
    ``deploy.endpoint_store`` / ``deploy.endpoint_name`` name (``endpoint_store``)."""
    if deploy is not None and getattr(deploy, "endpoint_store", ""):
        return PostgresEndpoint(deploy.endpoint_store, deploy.endpoint_name)
    return EndpointFile(Path(home) / "deployment" / "endpoint.json")


def endpoint_location(home: str | os.PathLike, deploy=None) -> str:
    """``endpoint_file``'s record as one string (a path, or ``URL#NAME``): for ``prodrl record
    --follow`` and a Ray actor on another host (``endpoint_store.open_endpoint``)."""
    ep = endpoint_file(home, deploy)
    return str(ep.path.resolve()) if ep.path is not None else str(ep)
