"""Where a managed fleet keeps the record of each slot's server: ``current`` (serving) and ``pending``
(started by a switch, not committed yet), for slots 0..N-1 and the canary; and the canary's
``retired`` (adapter canaries taken off traffic, unloaded at the next deploy).

On one host these are JSON files under the target's state directory (slot 0 at the top, the single
server's layout; ``replica-i/``, ``canary/``). In the documented topology the deploy step runs in
whichever Dagster run worker picks it up, on hosts that share no disk: a second host reading its own
empty directory would think no server runs, start a new one on a port the fleet holds and never stop
the old one. So when the endpoint record is a PostgreSQL row (``deploy.endpoint_store``), the slots'
records are rows beside it, keyed by the endpoint's name, the target and the slot, which every host
reads. The endpoint row's lock still orders the writers that matter (commit, canary changes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import read_json, write_json

TABLE = "prodrl_deploy_slots"
KINDS = ("pending", "current", "retired")


class FileSlots:
    """The slots' records as files under one host's state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)

    def identity(self) -> str:
        return str(self.dir.resolve())

    def slot_dir(self, slot: int | str) -> Path:
        if slot == 0:
            return self.dir
        return self.dir / (slot if isinstance(slot, str) else f"replica-{slot}")

    def read(self, slot: int | str, kind: str) -> dict | None:
        return read_json(self.slot_dir(slot) / f"{_kind(kind)}.json")

    def write(self, slot: int | str, kind: str, raw: dict) -> None:
        write_json(self.slot_dir(slot) / f"{_kind(kind)}.json", raw)

    def drop(self, slot: int | str, kind: str) -> None:
        (self.slot_dir(slot) / f"{_kind(kind)}.json").unlink(missing_ok=True)


class PostgresSlots:
    """The slots' records as rows of ``prodrl_deploy_slots`` (endpoint name, target, slot, kind)."""

    def __init__(self, url: str, endpoint_name: str, target: str) -> None:
        from prodrl_pipelines.config.preflight import libpq_dsn

        self.url, self.endpoint_name, self.target = url, endpoint_name, target
        self._dsn = libpq_dsn(url)

    def identity(self) -> str:
        # the database and the names, not the credentials: every host that shares the row names it alike
        from sqlalchemy.engine import make_url

        u = make_url(self.url)
        opts = "&".join(f"{k}={v}" for k, v in sorted(u.query.items()) if k != "password")  # a schema's search_path
        return f"{u.host}:{u.port or 5432}/{u.database}?{opts}#{self.endpoint_name}/{self.target}"

    def _run(self, sql: str, args: tuple, fetch: bool = False):
        import psycopg2

        from prodrl_pipelines.deploy_targets.endpoint_store import ensure_table

        conn = psycopg2.connect(self._dsn, connect_timeout=10)
        try:
            ensure_table(conn, self.url, TABLE, "endpoint text, target text, slot text, kind text, body jsonb NOT NULL, "
                         "updated_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (endpoint, target, slot, kind)")
            with conn.cursor() as cur:
                cur.execute(sql, args)
                row = cur.fetchone() if fetch else None
            conn.commit()
            return row
        finally:
            conn.close()

    def _key(self, slot, kind) -> tuple:
        return (self.endpoint_name, self.target, str(slot), _kind(kind))

    def read(self, slot: int | str, kind: str) -> dict | None:
        row = self._run(f"SELECT body FROM {TABLE} WHERE endpoint = %s AND target = %s AND slot = %s AND kind = %s",
                        self._key(slot, kind), fetch=True)
        return row[0] if row else None

    def write(self, slot: int | str, kind: str, raw: dict) -> None:
        self._run(f"INSERT INTO {TABLE} (endpoint, target, slot, kind, body) VALUES (%s, %s, %s, %s, %s) "
                  "ON CONFLICT (endpoint, target, slot, kind) DO UPDATE SET body = EXCLUDED.body, updated_at = now()",
                  (*self._key(slot, kind), json.dumps(raw)))

    def drop(self, slot: int | str, kind: str) -> None:
        self._run(f"DELETE FROM {TABLE} WHERE endpoint = %s AND target = %s AND slot = %s AND kind = %s",
                  self._key(slot, kind))


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"slot record kind {kind!r}: one of {KINDS}")
    return kind


def slots_for(state_dir: Path, deploy, target_name: str) -> FileSlots | PostgresSlots:
    """Rows beside the endpoint record when it is a database row (``deploy.endpoint_store``), else
    files under ``state_dir``."""
    store = getattr(deploy, "endpoint_store", "") if deploy is not None else ""
    if store:
        return PostgresSlots(store, deploy.endpoint_name, target_name)
    return FileSlots(state_dir)


def identity_digest(slots) -> str:
    """A short digest of where the slots live: what a deployment's Ray actors are named after, so that
    every host that deploys the fleet finds the same actors (and the same keeper)."""
    return hashlib.sha1(slots.identity().encode()).hexdigest()[:10]

