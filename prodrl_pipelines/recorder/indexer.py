"""Who hands out call indices and remembers a client's attempts: one process, or every replica.

A trajectory's calls are numbered 0, 1, 2, ... in commit order, and a client's retry of a call (same
attempt key) takes the earlier attempt's index. With one recorder that state lives in its memory
(``LocalIndexer``). With several recorders in front of several serving replicas, a trajectory's next
call, its feedback or a retry may reach any of them, so the state must be shared:
``PostgresIndexer`` keeps it in two small tables of a PostgreSQL database (the one the Dagster
instance already uses). Chosen by ``--coordination-url`` (``INDEXERS``: empty -> local,
``postgresql://...`` -> postgres).

Both answer ``assign(trajectory, attempt key, retry, created_at)``: the call's index, the
``created_at`` of the earlier attempt's row it supersedes, and whether it retried one. On
PostgreSQL that is one statement (``_ASSIGN_SQL``): it locks the trajectory's counter row, claims
the attempt with ``INSERT ... ON CONFLICT`` (which sees a concurrent replica's committed claim, where
a separate SELECT would not) and moves the counter only when a new index was handed out. Two
replicas given the same retry at once get the same index; a re-run of the statement by the same
caller (its connection dropped before the answer) is recognised by its token and answers the same.

The database is never waited on from the event loop: ``assign_async`` / ``known_async`` run on the
indexer's own threads (a slow database leaves the recorder's health checks and other routes
answering; a blocked thread pool of its own cannot starve the loop's default executor). Every
statement has a timeout (``statement_timeout``, unless the URL sets one: ``options=-c...``); a lost
connection is dropped and the next call reconnects, so a database restart costs the calls in flight
during it (answered 503: the client retries, with its attempt key, and gets the same index). Attempts
older than ``attempt_retention_s`` and counters idle for ``index_retention_s`` are deleted every
``prune_every_s`` by whichever replica gets there first.

A crash between handing out an index and the WAL's fsync leaves that index unused: the client got
no answer and retries (same attempt key: the same index, no gap), or the trajectory shows a gap and
validation quarantines it (``bad_call_index``), as for any lost turn.
"""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

MAX_ATTEMPTS = 65536  # (trajectory, attempt key) pairs a local indexer remembers
ATTEMPT_RETENTION_S = 24 * 3600  # a shared indexer forgets attempts older than this
# ... and a trajectory's counter idle this long (the store's log retention): a call after that starts
# its trajectory over at 0, which validation quarantines as a duplicate call id, never merges
INDEX_RETENTION_S = 30 * 24 * 3600
PRUNE_EVERY_S = 600.0
STATEMENT_TIMEOUT_MS = 5000
CONNECT_TIMEOUT_S = 5
POOL_SIZE = 4  # connections (and threads) per recorder process


class IndexerUnavailable(RuntimeError):
    """The coordination database cannot answer now (down, restarting, or past the statement timeout)."""


Assigned = tuple[int, "int | None", bool]  # (call index, created_at superseded, retried)


class LocalIndexer:
    """Indices and attempts in this process's memory (one recorder per store, or sticky routing).
    Not thread-safe: the ingestor calls it under its lock."""

    blocking = False  # answers from memory: fine on the event loop

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

    def assign(self, tid: str, key: str | None, retry: bool, created: int | None) -> Assigned:
        """The call's index: a retry of a remembered attempt takes its index (and supersedes its row),
        anything else the next one; the attempt is remembered with ``created``."""
        if key is not None and retry and (earlier := self._attempts.get((tid, key))) is not None:
            self._remember(tid, key, earlier[0], created)
            return earlier[0], earlier[1], True
        index = self._next.get(tid, 0)
        self._next[tid] = index + 1
        if key is not None:
            self._remember(tid, key, index, created)
        return index, None, False

    def _remember(self, tid: str, key: str, index: int, created: int | None) -> None:
        k = (tid, key)
        self._attempts[k] = (index, created)
        self._attempts.move_to_end(k)
        if len(self._attempts) > MAX_ATTEMPTS:
            self._attempts.popitem(last=False)

    def close(self) -> None:
        pass


INDEX_TABLE, ATTEMPTS_TABLE = "prodrl_call_index", "prodrl_call_attempts"

_SCHEMA_SQL = f"""
CREATE TABLE IF NOT EXISTS {INDEX_TABLE} (trajectory_id text PRIMARY KEY, next_index integer NOT NULL);
ALTER TABLE {INDEX_TABLE} ADD COLUMN IF NOT EXISTS seen_at double precision NOT NULL
    DEFAULT extract(epoch FROM now());
CREATE TABLE IF NOT EXISTS {ATTEMPTS_TABLE} (trajectory_id text NOT NULL, attempt_key text NOT NULL,
    call_index integer NOT NULL, created_at bigint, seen_at double precision NOT NULL,
    PRIMARY KEY (trajectory_id, attempt_key));
ALTER TABLE {ATTEMPTS_TABLE} ADD COLUMN IF NOT EXISTS token text;
ALTER TABLE {ATTEMPTS_TABLE} ADD COLUMN IF NOT EXISTS retried boolean NOT NULL DEFAULT false;
ALTER TABLE {ATTEMPTS_TABLE} ADD COLUMN IF NOT EXISTS prev_created_at bigint;
CREATE INDEX IF NOT EXISTS {ATTEMPTS_TABLE}_seen ON {ATTEMPTS_TABLE} (seen_at);
CREATE INDEX IF NOT EXISTS {INDEX_TABLE}_seen ON {INDEX_TABLE} (seen_at);
"""

# The counter row must exist before the statement below can lock it (a missing row locks nothing);
# both run in one implicit transaction, each statement seeing what committed before it started.
# Then, in one statement: lock the counter row (a concurrent assigner of this trajectory waits, and
# then reads the row it committed), claim the attempt (ON CONFLICT sees a claim committed after this
# statement's snapshot), and move the counter past the index only when the claim took a new one.
# On a conflict: the same token is this caller's own earlier run (answer what it answered); a retry
# keeps the attempt's index and supersedes its row; a non-retry with a known key is a new call.
_ASSIGN_SQL = f"""
INSERT INTO {INDEX_TABLE} (trajectory_id, next_index, seen_at) VALUES (%(t)s, 0, %(now)s)
ON CONFLICT (trajectory_id) DO NOTHING;
WITH cur AS (
    SELECT next_index FROM {INDEX_TABLE} WHERE trajectory_id = %(t)s FOR UPDATE
), claim AS (
    INSERT INTO {ATTEMPTS_TABLE} AS a (trajectory_id, attempt_key, call_index, created_at, seen_at, token,
                                       retried, prev_created_at)
    SELECT %(t)s, %(k)s, cur.next_index, %(c)s, %(now)s, %(tok)s, false, NULL FROM cur
    ON CONFLICT (trajectory_id, attempt_key) DO UPDATE SET
        call_index = CASE WHEN a.token = EXCLUDED.token OR %(r)s THEN a.call_index ELSE EXCLUDED.call_index END,
        retried = CASE WHEN a.token = EXCLUDED.token THEN a.retried ELSE %(r)s END,
        prev_created_at = CASE WHEN a.token = EXCLUDED.token THEN a.prev_created_at
                               WHEN %(r)s THEN a.created_at END,
        created_at = CASE WHEN a.token = EXCLUDED.token THEN a.created_at ELSE EXCLUDED.created_at END,
        token = EXCLUDED.token, seen_at = EXCLUDED.seen_at
    RETURNING call_index, prev_created_at, retried
), bump AS (
    UPDATE {INDEX_TABLE} AS i SET next_index = claim.call_index + 1, seen_at = %(now)s FROM claim
    WHERE i.trajectory_id = %(t)s AND claim.call_index >= i.next_index
)
SELECT call_index, prev_created_at, retried FROM claim
"""


class PostgresIndexer:
    """Indices and attempts shared by every recorder on one PostgreSQL database (see the module
    docstring). Its two tables are created on first use in the connection's schema (the URL's
    ``options=-csearch_path=...`` chooses one). Thread-safe: a small pool of connections."""

    blocking = True  # callers on an event loop use the *_async methods

    def __init__(self, url: str, *, statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
                 connect_timeout_s: int = CONNECT_TIMEOUT_S, attempt_retention_s: float = ATTEMPT_RETENTION_S,
                 index_retention_s: float = INDEX_RETENTION_S, prune_every_s: float = PRUNE_EVERY_S,
                 pool_size: int = POOL_SIZE, clock: Callable[[], float] = time.time) -> None:
        from prodrl_pipelines.config.preflight import libpq_dsn

        self.url, self._dsn = url, libpq_dsn(url)
        self.statement_timeout_ms, self.connect_timeout_s = int(statement_timeout_ms), int(connect_timeout_s)
        self.attempt_retention_s, self.index_retention_s = float(attempt_retention_s), float(index_retention_s)
        self.prune_every_s, self.clock = float(prune_every_s), clock
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._pool_size = max(int(pool_size), 1)
        self._executor = ThreadPoolExecutor(self._pool_size, thread_name_prefix="prodrl-indexer")
        self._next_prune = 0.0
        try:
            self._run(self._create, retry=False)
        except IndexerUnavailable as e:
            self._executor.shutdown(wait=False)
            raise ValueError(f"coordination database {url!r} cannot be reached: {e}") from None

    # --- connections ------------------------------------------------------------------------

    def _connect(self):
        import psycopg2

        try:
            conn = psycopg2.connect(self._dsn, connect_timeout=self.connect_timeout_s, application_name="prodrl-indexer",
                                    keepalives=1, keepalives_idle=10, keepalives_interval=3, keepalives_count=3)
        except psycopg2.Error as e:
            raise IndexerUnavailable(str(e).strip() or type(e).__name__) from None
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SHOW statement_timeout")
            if cur.fetchone()[0] in ("0", "0ms"):  # the URL's options did not set one
                cur.execute("SET statement_timeout = %s", (self.statement_timeout_ms,))
        return conn

    def _run(self, fn, *, retry: bool = True):
        """``fn(cursor)`` on a pooled connection. A lost connection is closed and, when ``retry``
        (``fn`` may run twice), the call runs once more on a new one; else ``IndexerUnavailable``."""
        import psycopg2

        for attempt in range(2 if retry else 1):
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = None
            try:
                if conn is None or conn.closed:
                    conn = self._connect()
                with conn.cursor() as cur:
                    out = fn(cur)
            except psycopg2.errors.QueryCanceled:  # past the statement timeout: the connection is fine
                self._give_back(conn)
                raise IndexerUnavailable(f"the coordination database did not answer within "
                                         f"{self.statement_timeout_ms} ms") from None
            except (psycopg2.OperationalError, psycopg2.InterfaceError, IndexerUnavailable) as e:
                if conn is not None:
                    conn.close()
                if attempt == (1 if retry else 0):
                    raise IndexerUnavailable(f"the coordination database is unavailable: "
                                             f"{str(e).strip() or type(e).__name__}") from None
                continue
            self._give_back(conn)
            return out

    def _give_back(self, conn) -> None:
        if conn.closed or self._idle.qsize() >= self._pool_size:
            conn.close()
        else:
            self._idle.put(conn)

    def _create(self, cur) -> None:
        cur.execute("SELECT pg_advisory_lock(hashtext(%s))", (INDEX_TABLE,))  # replicas starting at once
        try:
            cur.execute(_SCHEMA_SQL)
        finally:
            cur.execute("SELECT pg_advisory_unlock(hashtext(%s))", (INDEX_TABLE,))

    # --- the interface --------------------------------------------------------------------------

    def known(self, tid: str) -> bool:
        def q(cur):
            cur.execute(f"SELECT 1 FROM {INDEX_TABLE} WHERE trajectory_id = %s", (tid,))
            return cur.fetchone() is not None
        return self._run(q)

    def next_index(self, tid: str) -> int:
        def q(cur):
            cur.execute(f"SELECT next_index FROM {INDEX_TABLE} WHERE trajectory_id = %s", (tid,))
            row = cur.fetchone()
            return 0 if row is None else int(row[0])
        return self._run(q)

    def see(self, pairs: Iterable[tuple[str, int]]) -> None:
        from psycopg2.extras import execute_values

        top: dict[str, int] = {}
        for tid, index in pairs:
            top[tid] = max(top.get(tid, -1), int(index))
        if not top:
            return
        now = self.clock()

        def q(cur):  # idempotent (GREATEST): safe to run again after a lost connection
            execute_values(cur, f"INSERT INTO {INDEX_TABLE} AS t (trajectory_id, next_index, seen_at) VALUES %s "
                                "ON CONFLICT (trajectory_id) DO UPDATE SET next_index = "
                                "GREATEST(t.next_index, EXCLUDED.next_index), seen_at = EXCLUDED.seen_at",
                           [(tid, i + 1, now) for tid, i in top.items()], page_size=1000)
        self._run(q)

    def assign(self, tid: str, key: str | None, retry: bool, created: int | None) -> Assigned:
        """One atomic statement (see the module docstring); a call without an attempt key gets a key
        of its own, so that a re-run after a lost connection is recognised all the same."""
        params = {"t": tid, "k": key if key is not None else f"~{uuid.uuid4().hex}", "r": bool(retry and key),
                  "c": created, "tok": uuid.uuid4().hex, "now": self.clock()}

        def q(cur):
            cur.execute(_ASSIGN_SQL, params)
            index, prev, retried = cur.fetchone()
            return int(index), None if prev is None else int(prev), bool(retried)
        out = self._run(q)  # the token makes a second run answer what the first did
        self._maybe_prune()
        return out

    async def assign_async(self, tid: str, key: str | None, retry: bool, created: int | None) -> Assigned:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.assign, tid, key, retry, created)

    async def known_async(self, tid: str) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.known, tid)

    # --- bounded tables ---------------------------------------------------------------------

    def _maybe_prune(self) -> None:
        now = self.clock()
        if now < self._next_prune:
            return
        self._next_prune = now + self.prune_every_s
        try:
            self.prune()
        except IndexerUnavailable:  # the next period tries again; the call itself was indexed
            pass

    def prune(self) -> dict[str, int]:
        """Delete attempts older than the attempt retention and counters idle past the index
        retention (both idempotent: replicas may prune at once). Returns rows deleted per table."""
        now = self.clock()

        def q(cur):
            cur.execute(f"DELETE FROM {ATTEMPTS_TABLE} WHERE seen_at < %s", (now - self.attempt_retention_s,))
            attempts = cur.rowcount
            cur.execute(f"DELETE FROM {INDEX_TABLE} WHERE seen_at < %s", (now - self.index_retention_s,))
            return {ATTEMPTS_TABLE: attempts, INDEX_TABLE: cur.rowcount}
        return self._run(q)

    def close(self) -> None:
        self._executor.shutdown(wait=False)
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


def make_indexer(coordination_url: str = ""):
    """``LocalIndexer`` for an empty URL, ``PostgresIndexer`` for a PostgreSQL one."""
    if not coordination_url:
        return LocalIndexer()
    if coordination_url.startswith(("postgresql://", "postgresql+psycopg2://", "postgres://")):
        return PostgresIndexer(coordination_url)
    raise ValueError(f"--coordination-url must be empty (this process) or postgresql://...; got {coordination_url!r}")
