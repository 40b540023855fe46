"""The shared call indexer against a PostgreSQL of its own (started here, so it can be slowed down,
stopped and restarted without touching the database every other test uses): concurrent retries on
two replicas, a slow database, a restart under traffic, and bounded tables."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore
from tests.test_recorder import fake, serving, start_recorder  # noqa: F401 - fixtures

BODY = {"prompt": [1, 2, 3], "max_tokens": 3}


class PrivatePostgres:
    """A throw-away PostgreSQL cluster on a free loopback port (trust auth, database ``postgres``)."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if not bins:
            pytest.skip("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin) to start a private cluster")
        self.bin = Path(bins[-1]).parent
        self.root = Path(tempfile.mkdtemp(prefix="prodrl-pg-"))  # not under pytest's 0700 tmp: postgres reads it
        self.data, self.sock, self.log = self.root / "data", self.root / "sock", self.root / "log"
        self.sock.mkdir()
        self.as_user = []
        if os.geteuid() == 0:  # the server refuses to run as root
            shutil.chown(self.root, "postgres")
            shutil.chown(self.sock, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.as_user, str(self.bin / tool), *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start", "-o",
                  f"-p {self.port} -k {self.sock} -h 127.0.0.1 -c fsync=off")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "stop", "-m", "fast")

    def connect(self):
        import psycopg2

        conn = psycopg2.connect(self.url)
        conn.autocommit = True
        return conn

    def waiting_on_locks(self) -> int:
        """Statements of the recorders' indexers waiting on a lock right now."""
        with self.connect() as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%prodrl_call%'")
            n = cur.fetchone()[0]
        conn.close()
        return int(n)

    def remove(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_pg():
    pg = PrivatePostgres()
    yield pg
    pg.remove()


def _wait_until(predicate, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s  # a ceiling: a loaded machine may need long
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting until {what}")


def _call(r, tid: str, key: str, seed: int) -> httpx.Response:
    return r.http.post("/v1/completions", json={**BODY, "seed": seed},
                       headers={"X-Trajectory-Id": tid, "Idempotency-Key": key})


def _lock_in_another_session(pg: PrivatePostgres, table: str, mode: str):
    conn = pg.connect()
    conn.autocommit = False
    cur = conn.cursor()
    cur.execute(f"LOCK TABLE {table} IN {mode} MODE")
    return conn


def test_a_retry_reaching_two_replicas_at_once_takes_one_index(fake, start_recorder, tmp_path, private_pg):
    """A client's call and its retry (same Idempotency-Key) reach two replicas while the database is
    slow to write: both answers carry one index, and the trajectory holds one call."""
    store = tmp_path / "store"
    a, b = (start_recorder(fake.url, store, tokenizer_dir=None, wal_dir=str(tmp_path / f"wal-{n}"),
                           coordination_url=private_pg.url) for n in "ab")
    assert _call(a, "t", "first", 0).status_code == 200  # the trajectory's call 0
    lock = _lock_in_another_session(private_pg, "prodrl_call_attempts", "EXCLUSIVE")  # reads pass, writes wait
    answers: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda r=r, n=n: answers.__setitem__(n, _call(r, "t", "k", 1)))
               for n, r in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    _wait_until(lambda: private_pg.waiting_on_locks() >= 2, "both replicas wait on the database")
    lock.rollback()
    lock.close()
    for t in threads:
        t.join(120)
    assert [answers[n].status_code for n in "ab"] == [200, 200]
    assert answers["a"].headers["x-call-index"] == answers["b"].headers["x-call-index"] == "1"
    assert _call(b, "t", "next", 2).headers["x-call-index"] == "2"  # no index was burnt
    for r in (a, b):
        r.stop()
    calls = TrajectoryStore(LocalBlobStore(store)).read_calls()
    assert sorted(calls["call_index"].to_pylist()) == [0, 1, 2]


def test_a_slow_database_does_not_stall_the_recorder(fake, start_recorder, tmp_path, private_pg):
    """While a call waits on the coordination database, the recorder's other routes answer."""
    url = private_pg.url + "?options=-c%20statement_timeout%3D120000"  # the call waits for the lock, not less
    r = start_recorder(fake.url, tmp_path / "store", tokenizer_dir=None, coordination_url=url)
    assert _call(r, "s", "first", 0).status_code == 200
    lock = _lock_in_another_session(private_pg, "prodrl_call_index", "ACCESS EXCLUSIVE")
    answer: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answer.append(_call(r, "s", "k", 1)))
    t.start()
    try:
        _wait_until(lambda: private_pg.waiting_on_locks() >= 1, "the call waits on the database")
        with httpx.Client(base_url=r.srv.url, timeout=60, headers=r.http.headers) as other:
            assert other.get("/health").status_code == 200
            assert other.get("/stats").status_code == 200
    finally:
        lock.rollback()
        lock.close()
        t.join(120)
    assert answer and answer[0].status_code == 200 and answer[0].headers["x-call-index"] == "1"


def test_a_database_restart_under_traffic_costs_only_the_calls_in_flight(fake, start_recorder, tmp_path, private_pg):
    """A client keeps calling (and retrying a failed call with its Idempotency-Key) while the
    coordination database restarts: the recorder reconnects by itself, and every call is recorded
    once, numbered without a gap."""
    store = tmp_path / "store"
    r = start_recorder(fake.url, store, tokenizer_dir=None, coordination_url=private_pg.url)
    done, failures, indices = threading.Event(), [], []

    def client() -> None:
        n = 0
        while not done.is_set() or n < 30:
            deadline = time.monotonic() + 180  # a call is retried until it is recorded (the restart's ceiling)
            while True:
                resp = _call(r, "restart", f"call-{n}", n)
                if resp.status_code == 200:
                    indices.append(int(resp.headers["x-call-index"]))
                    break
                failures.append(resp.status_code)
                if time.monotonic() > deadline:
                    raise AssertionError(f"call {n} never recorded: {failures[-3:]}")
                time.sleep(0.05)
            n += 1

    t = threading.Thread(target=client)
    t.start()
    _wait_until(lambda: len(indices) >= 5, "traffic flows")
    private_pg.stop()
    _wait_until(lambda: len(failures) >= 3, "calls fail while the database is down")
    private_pg.start()
    seen = len(indices)
    _wait_until(lambda: len(indices) >= seen + 10, "calls are recorded again after the restart")
    done.set()
    t.join(300)
    assert set(failures) == {503}  # refused as not recorded, never a 500
    assert indices == list(range(len(indices)))
    r.stop()
    calls = TrajectoryStore(LocalBlobStore(store)).read_calls()
    assert sorted(calls["call_index"].to_pylist()) == indices


def test_attempts_and_idle_counters_are_pruned_while_running(private_pg):
    """Attempts past their retention are deleted periodically (not only at start), counters of
    trajectories idle past theirs too; a retry of a forgotten attempt is a new call."""
    from prodrl_pipelines.recorder.indexer import PostgresIndexer

    now = [1_000_000.0]
    ix = PostgresIndexer(private_pg.url, attempt_retention_s=3600, index_retention_s=30 * 86400,
                         prune_every_s=600, clock=lambda: now[0])

    def rows(table: str) -> int:
        with private_pg.connect() as conn, conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM {table}")
            return int(cur.fetchone()[0])

    for k in range(20):
        ix.assign("old", f"k{k}", True, k)
    assert ix.assign("old", "k3", True, 99) == (3, 3, True)
    assert rows("prodrl_call_attempts") == 20
    now[0] += 7200  # two hours on: the next call prunes what is past the hour's retention
    assert ix.assign("fresh", "x", True, 1) == (0, None, False)
    assert rows("prodrl_call_attempts") == 1
    assert ix.assign("old", "k3", True, 100) == (20, None, False)  # forgotten: a new call, no gap
    now[0] += 31 * 86400
    assert ix.prune() == {"prodrl_call_attempts": 2, "prodrl_call_index": 2}
    assert not ix.known("old") and not ix.known("fresh")
    ix.close()


def test_two_indexers_under_concurrent_retries_hand_out_each_index_once(pg_url):
    """Eight threads on two indexers (two replicas) assign calls of one trajectory: seeded random
    attempt keys, each sent several times (a retry), mixed with calls without a key. Every key gets
    one index, every keyless call its own, and together they are 0..n-1 without a gap."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from prodrl_pipelines.recorder.indexer import PostgresIndexer

    replicas = [PostgresIndexer(pg_url), PostgresIndexer(pg_url)]
    rng = random.Random(7)
    plan = [(rng.choice(replicas), None if rng.random() < 0.2 else f"k{rng.randrange(40)}") for _ in range(240)]

    def run(chunk):
        return [(key, ix.assign("crowd", key, True, 1)) for ix, key in chunk]

    with ThreadPoolExecutor(8) as pool:
        results = [r for part in pool.map(run, [plan[i::8] for i in range(8)]) for r in part]
    by_key: dict[str, set[int]] = {}
    keyless = []
    for key, (index, _, _) in results:
        (keyless.append(index) if key is None else by_key.setdefault(key, set()).add(index))
    assert all(len(v) == 1 for v in by_key.values()), {k: v for k, v in by_key.items() if len(v) > 1}
    handed = sorted([next(iter(v)) for v in by_key.values()] + keyless)
    assert handed == list(range(len(handed)))
    assert sum(retried for _, (_, _, retried) in results) == len(results) - len(handed)
    for ix in replicas:
        ix.close()
