"""Who hands out call indices and remembers a client's attempts: one process, or every replica.

A trajectory's calls are numbered 0, 1, 2, ... in commit order, and a client's retry of a call (same
attempt key) takes the earlier attempt's index. With one recorder that state lives in its memory
(``LocalIndexer``). With several recorders in front of several serving replicas, a trajectory's next
call, its feedback or a retry may reach any of them, so the state must be shared:
``PostgresIndexer`` keeps it in two small tables of a PostgreSQL database (the one the Dagster
instance already uses), one atomic statement per call. Chosen by ``--coordination-url``
(``INDEXERS``: empty -> local, ``postgresql://...`` -> postgres).

A crash between handing out an index and the WAL's fsync leaves that index unused: the client got
no answer and retries (same attempt key: the same index, no gap), or the trajectory shows a gap and
validation quarantines it (``bad_call_index``), as for any lost turn.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

MAX_ATTEMPTS = 65536  # (trajectory, attempt key) pairs a local indexer remembers
ATTEMPT_RETENTION_S = 24 * 3600  # a shared indexer forgets attempts older than this


class LocalIndexer:
    """Indices and attempts in this process's memory (one recorder per store, or sticky routing)."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._attempts: OrderedDict[tuple[str, str], tuple[int, int | None]] = OrderedDict()

    def known(self, tid: str) -> bool:
        return tid in self._next

    def next_index(self, tid: str) -> int:
        return self._next.get(tid, 0)

    def see(self, pairs: Iterable[tuple[str, int]]) -> None:
        """Calls found in the store or the WAL: the next index is past each of them."""
        for tid, index in pairs:
            if index + 1 > self._next.get(tid, 0):
                self._next[tid] = index + 1

    def earlier(self, tid: str, key: str) -> tuple[int, int | None] | None:
        return self._attempts.get((tid, key))

    def take(self, tid: str) -> int:
        index = self._next.get(tid, 0)
        self._next[tid] = index + 1
        return index

    def remember(self, tid: str, key: str, index: int, created: int | None) -> None:
        k = (tid, key)
        self._attempts[k] = (index, created)
        self._attempts.move_to_end(k)
        if len(self._attempts) > MAX_ATTEMPTS:
            self._attempts.popitem(last=False)

    def close(self) -> None:
        pass


class PostgresIndexer:
    """Indices and attempts shared by every recorder on one PostgreSQL database (see the module
    docstring). Its two tables are created on first use in the connection's schema (the URL's
    ``options=-csearch_path=...`` chooses one)."""

    def __init__(self, url: str) -> None:
        import psycopg2

        from prodrl_pipelines.config.preflight import libpq_dsn

        self.url = url
        try:
            self.conn = psycopg2.connect(libpq_dsn(url), connect_timeout=5)
        except psycopg2.Error as e:
            raise ValueError(f"coordination database {url!r} cannot be reached: {str(e).strip()}") from None
        self.conn.autocommit = True
        self.index_table, self.attempts_table = "prodrl_call_index", "prodrl_call_attempts"
        with self.conn.cursor() as cur:
            cur.execute(f"CREATE TABLE IF NOT EXISTS {self.index_table} "
                        "(trajectory_id text PRIMARY KEY, next_index integer NOT NULL)")
            cur.execute(f"CREATE TABLE IF NOT EXISTS {self.attempts_table} (trajectory_id text NOT NULL, "
                        "attempt_key text NOT NULL, call_index integer NOT NULL, created_at bigint, "
                        "seen_at double precision NOT NULL, PRIMARY KEY (trajectory_id, attempt_key))")
            cur.execute(f"DELETE FROM {self.attempts_table} WHERE seen_at < %s", (time.time() - ATTEMPT_RETENTION_S,))

    def known(self, tid: str) -> bool:
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT 1 FROM {self.index_table} WHERE trajectory_id = %s", (tid,))
            return cur.fetchone() is not None

    def next_index(self, tid: str) -> int:
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT next_index FROM {self.index_table} WHERE trajectory_id = %s", (tid,))
            row = cur.fetchone()
            return 0 if row is None else int(row[0])

    def see(self, pairs: Iterable[tuple[str, int]]) -> None:
        from psycopg2.extras import execute_values

        top: dict[str, int] = {}
        for tid, index in pairs:
            top[tid] = max(top.get(tid, -1), int(index))
        if not top:
            return
        with self.conn.cursor() as cur:
            execute_values(cur, f"INSERT INTO {self.index_table} AS t (trajectory_id, next_index) VALUES %s "
                                "ON CONFLICT (trajectory_id) DO UPDATE SET next_index = "
                                "GREATEST(t.next_index, EXCLUDED.next_index)",
                           [(tid, i + 1) for tid, i in top.items()], page_size=1000)

    def earlier(self, tid: str, key: str) -> tuple[int, int | None] | None:
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT call_index, created_at FROM {self.attempts_table} "
                        "WHERE trajectory_id = %s AND attempt_key = %s", (tid, key))
            row = cur.fetchone()
            return None if row is None else (int(row[0]), None if row[1] is None else int(row[1]))

    def take(self, tid: str) -> int:
        with self.conn.cursor() as cur:  # one atomic statement: two replicas never get the same index
            cur.execute(f"INSERT INTO {self.index_table} AS t (trajectory_id, next_index) VALUES (%s, 1) "
                        "ON CONFLICT (trajectory_id) DO UPDATE SET next_index = t.next_index + 1 "
                        "RETURNING next_index - 1", (tid,))
            return int(cur.fetchone()[0])

    def remember(self, tid: str, key: str, index: int, created: int | None) -> None:
        with self.conn.cursor() as cur:
            cur.execute(f"INSERT INTO {self.attempts_table} VALUES (%s, %s, %s, %s, %s) "
                        "ON CONFLICT (trajectory_id, attempt_key) DO UPDATE SET call_index = EXCLUDED.call_index, "
                        "created_at = EXCLUDED.created_at, seen_at = EXCLUDED.seen_at",
                        (tid, key, index, created, time.time()))

    def close(self) -> None:
        self.conn.close()


def make_indexer(coordination_url: str = ""):
    """``LocalIndexer`` for an empty URL, ``PostgresIndexer`` for a PostgreSQL one."""
    if not coordination_url:
        return LocalIndexer()
    if coordination_url.startswith(("postgresql://", "postgresql+psycopg2://", "postgres://")):
        return PostgresIndexer(coordination_url)
    raise ValueError(f"--coordination-url must be empty (this process) or postgresql://...; got {coordination_url!r}")
