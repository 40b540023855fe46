"""Durable ingest of recorded calls and rewards: WAL first, then atomic commits to the store's tables.

``Ingestor`` is the recorder's storage engine (no HTTP here):

* ``commit_call`` / ``commit_skip`` / ``commit_reward`` queue an entry for the write-ahead log and
  return a ``concurrent.futures.Future`` that resolves once the entry is fsynced. The caller
  answers its client only then, so an acknowledged record survives a crash (``kill -9``) of the
  process. A writer thread appends the queued entries in groups: one ``write`` + ``fdatasync`` per
  group, however many requests are waiting.
* Call indices are assigned at commit time, in commit order per trajectory (0, 1, 2, ...). An
  unrecordable call still takes its index (a ``skip`` entry): the trajectory really had that call,
  so its recorded calls show the gap and validation quarantines it (``bad_call_index``) instead of
  training on an episode with a missing turn. Skips are kept as small JSON parts under
  ``_recorder/skipped/`` so indices stay right across restarts.
* The writer seals the current segment when it holds ``flush_rows`` entries or is older than
  ``flush_interval_s``; a flusher thread writes the sealed entries through ``TrajectoryStore``
  (``write_calls`` / ``write_rewards``: one atomic commit each) and then deletes the segment. Each
  commit carries (the WAL's ``writer_id``, the segment number) as a Delta application transaction.
  A failed flush is retried (never dropped) and counted; a retry first asks the tables whether the
  earlier attempt's commit landed (its answer lost), and writes only what did not.
* A client's retry of a call it got no answer to (same ``attempt`` key within the trajectory, see
  ``commit_call``) takes the earlier attempt's call index: its entry carries ``supersedes`` (the
  earlier row's ``created_at``), and the flush retracts the earlier row
  (``TrajectoryStore.retract_calls``) before writing the retry's. Indices and attempt keys live in
  the ``indexer`` (``recorder.indexer``): this process's memory (the last ``MAX_ATTEMPTS``; a retry
  after a restart appends), or PostgreSQL shared by every replica of a fleet.
* ``recover`` (on start) replays every segment left by a previous process: a segment whose
  commit the table's application transaction shows landed is skipped, as are entries whose call id
  (trajectory_id, call_index) or reward identity (trajectory_id, source, created_at, reward) is
  already in the store -- a crash between a commit and deleting its segment --,
  the rest are written, then the segments are deleted. It also rebuilds the per-trajectory next
  call index and the set of known trajectories from the store (a scan of the key columns of every
  call part, retracted rows included; fine for the volumes of one deployment, a compacted index would be the next step).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path


from prodrl_pipelines.recorder.counters import Stats, now_us
from prodrl_pipelines.recorder.indexer import LocalIndexer
from prodrl_pipelines.recorder.skips import SKIPPED_PREFIX, write_skips
from prodrl_pipelines.recorder.wal import WriteAheadLog, encode_entry, seq_of
from prodrl_pipelines.recorder.wal_replay import replay_plan, retraction_of
from prodrl_pipelines.trajectories.schema import CALL_SCHEMA, REWARD_SCHEMA
from prodrl_pipelines.trajectories.store import CALLS as CALLS_T
from prodrl_pipelines.trajectories.store import RETRACTIONS as RETRACTIONS_T
from prodrl_pipelines.trajectories.store import REWARDS as REWARDS_T
from prodrl_pipelines.trajectories.store import SchemaMismatchError, TrajectoryStore, name_problem, to_table, uuid7

log = logging.getLogger(__name__)

__all__ = ["Ingestor", "Attempt", "SKIPPED_PREFIX", "REJECTED_PREFIX"]

REJECTED_PREFIX = "_recorder/rejected/"
MAX_READY_BACKLOG = 16  # sealed segments waiting for the store beyond which the recorder is not ready


@dataclass
class _Pending:
    entry: dict
    future: Future | asyncio.Future
    t: float = field(default_factory=time.perf_counter)  # when it was queued


@dataclass
class _Sealed:
    path: Path | None
    entries: list[dict]
    done: list[threading.Event] = field(default_factory=list)
    attempts: int = 0


@dataclass(frozen=True)
class Attempt:
    """What identifies one call across a client's retries: ``key`` (an ``Idempotency-Key``, or the
    request body's digest), and whether this request is a retry (``Idempotency-Key`` always may be;
    a digest only with a retry count > 0)."""

    key: str
    retry: bool


class Ingestor:
    """WAL-backed, exactly-once ingest of calls, skips and rewards into a ``TrajectoryStore``."""

    def __init__(
        self,
        store: TrajectoryStore,
        wal_dir: str | Path,
        *,
        flush_rows: int = 1024,
        flush_interval_s: float = 2.0,
        stats: Stats | None = None,
        indexer=None,
        on_group_commit=None,
    ) -> None:
        self.store = store
        # called from the writer thread after each durable group: (append seconds, each entry's wait)
        self.on_group_commit = on_group_commit
        self.wal = WriteAheadLog(wal_dir)
        self.flush_rows = max(int(flush_rows), 1)
        self.flush_interval_s = float(flush_interval_s)
        self.stats = stats or Stats()
        self._lock = threading.Lock()  # call-index state
        # call indices and attempts: this process's memory, or shared by every replica (indexer.py)
        self.indexer = indexer if indexer is not None else LocalIndexer()
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._flush_waiters: list[threading.Event] = []
        self._stopping = False
        self._flushq: queue.Queue[_Sealed | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._flusher: threading.Thread | None = None
        self._recovered = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failing_since: float | None = None  # monotonic time of the first of the current failed flushes
        self.last_flush_error = ""

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Commits made on ``loop``'s thread then return asyncio futures, and each fsynced group
        wakes the loop once (one ``call_soon_threadsafe`` per group, not per record)."""
        self._loop = loop

    # ------------------------------------------------------------------ state

    def known(self, trajectory_id: str) -> bool:
        """True when the trajectory has at least one committed call (recorded or skipped)."""
        with self._lock:
            return self.indexer.known(trajectory_id)

    async def known_async(self, trajectory_id: str) -> bool:
        """``known`` without waiting on a shared indexer's database on the event loop."""
        if self.indexer.blocking:
            return await self.indexer.known_async(trajectory_id)
        return self.known(trajectory_id)

    def next_index(self, trajectory_id: str) -> int:
        with self._lock:
            return self.indexer.next_index(trajectory_id)

    # ------------------------------------------------------------------ recovery

    def recover(self) -> dict[str, int]:
        """Replay the WAL into the store (exactly once) and rebuild the index state; call before
        ``start``. Returns counts (also added to ``stats``)."""
        plan = replay_plan(self.store, self.wal, self._committed)
        counts, segments = plan.counts, plan.segments
        new_calls, new_rewards, new_skips, new_retractions = plan.calls, plan.rewards, plan.skips, plan.retractions
        self.indexer.see(plan.seen)
        if new_calls or new_rewards or new_skips or new_retractions:
            self._write(new_calls, new_rewards, new_skips, new_retractions,
                        seq=seq_of(segments[-1]) if segments else None)
        counts["replayed_calls"] += len(new_calls)
        counts["replayed_rewards"] += len(new_rewards)
        counts["replayed_skips"] += len(new_skips)
        counts["replayed_retractions"] += len(new_retractions)
        counts["replayed_segments"] += len(segments)
        for path in segments:
            self.wal.delete(path)
        for k, v in counts.items():
            self.stats.inc(k, v)
        self._recovered = True
        return dict(counts)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if not self._recovered:
            self.recover()
        self.wal.open()
        self._stopping = False
        self._writer = threading.Thread(target=self._write_loop, name="recorder-wal", daemon=True)
        self._flusher = threading.Thread(target=self._flush_loop, name="recorder-flush", daemon=True)
        self._writer.start()
        self._flusher.start()

    def stop(self, timeout: float = 60.0) -> int:
        """Flush everything committed so far to Parquet, then stop the threads. Returns how many
        write-ahead log segments still hold entries: 0 when everything is in the store (else the flush
        did not finish within ``timeout``; they are replayed at the next start)."""
        if self._writer is None:
            return 0
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._writer.join(timeout)
        self._flushq.put(None)
        assert self._flusher is not None
        self._flusher.join(timeout)
        self.wal.close()
        left = 0
        for path in self.wal.segments():  # the last, empty segment; and any the flush did not finish
            if not self.wal.read_segment(path).entries:
                self.wal.delete(path)
            else:
                left += 1
        self._writer = self._flusher = None
        return left

    def flush(self, timeout: float = 60.0) -> bool:
        """Seal the current segment and wait until everything committed before is in Parquet."""
        ev = threading.Event()
        with self._cond:
            if self._writer is None:
                return True
            self._flush_waiters.append(ev)
            self._cond.notify_all()
        return ev.wait(timeout)

    def backlog(self) -> int:
        """Sealed WAL segments waiting for the store."""
        return self._flushq.qsize()

    def readiness(self) -> dict[str, tuple[bool, str]]:
        """What a readiness probe asks of the storage path: the WAL accepts records, and the store
        takes the sealed segments (none failing, at most a bounded backlog waiting)."""
        accepting = not self._stopping and self._writer is not None and self._writer.is_alive()
        backlog = self.backlog()
        out = {"wal": (accepting, "accepting records" if accepting else "not accepting records (stopped)")}
        if self.failing_since is not None:
            out["store"] = (False, f"flushes to the store failing for {time.monotonic() - self.failing_since:.0f} s "
                                   f"({self.last_flush_error}); records wait in the WAL")
        else:
            out["store"] = (backlog <= MAX_READY_BACKLOG,
                            f"{backlog} sealed WAL segments waiting (at most {MAX_READY_BACKLOG} when ready)")
        return out

    # ------------------------------------------------------------------ commits

    def _submit(self, entry: dict) -> Future | asyncio.Future:
        fut = self._loop.create_future() if self._loop is not None else Future()
        with self._cond:
            if self._stopping or self._writer is None:
                fut.set_exception(RuntimeError("the recorder is not accepting records (stopped)"))
                return fut
            self._queue.append(_Pending(entry, fut))
            self._cond.notify()
        return fut

    def _assign(self, tid: str, attempt: Attempt | None, created: int | None) -> tuple[int, int | None, bool]:
        """(call index, created_at of the row it supersedes, whether it retries an earlier attempt).
        A shared indexer decides in its database, atomically; the local one under ``_lock``."""
        key, retry = (attempt.key, attempt.retry) if attempt is not None else (None, False)
        if self.indexer.blocking:
            return self.indexer.assign(tid, key, retry, created)
        with self._lock:
            return self.indexer.assign(tid, key, retry, created)

    async def _assign_async(self, tid: str, attempt: Attempt | None, created: int | None):
        if self.indexer.blocking:  # off the event loop: a slow database must not stall every route
            key, retry = (attempt.key, attempt.retry) if attempt is not None else (None, False)
            return await self.indexer.assign_async(tid, key, retry, created)
        return self._assign(tid, attempt, created)

    def _enqueue(self, entry: dict, supersedes: int | None) -> Future | asyncio.Future:
        if supersedes is not None:
            entry["supersedes"] = supersedes
        return self._submit(entry)

    @staticmethod
    def _call_entry(tid: str, row: dict, index: int, created: int) -> dict:
        row.update(trajectory_id=tid, call_index=index, created_at=created)
        return {"kind": "call", "row": row}

    @staticmethod
    def _skip_entry(tid: str, reason: str, index: int) -> dict:
        return {"kind": "skip", "trajectory_id": tid, "call_index": index, "reason": reason, "created_at": now_us()}

    def commit_call(self, trajectory_id: str, row: dict, attempt: Attempt | None = None) -> tuple[int, Future, bool]:
        """Assign the call's index, queue its row; ``row`` gets trajectory_id, call_index and
        created_at (microseconds). A retry of an earlier attempt (``attempt.retry`` with the key of an
        attempt committed before) takes that attempt's index and supersedes its row. Returns
        (call_index, durable future, retried). On an event loop with a shared indexer, use
        ``commit_call_async``."""
        created = now_us()
        index, supersedes, retried = self._assign(trajectory_id, attempt, created)
        return index, self._enqueue(self._call_entry(trajectory_id, row, index, created), supersedes), retried

    async def commit_call_async(self, trajectory_id: str, row: dict,
                                attempt: Attempt | None = None) -> tuple[int, Future, bool]:
        """``commit_call`` without waiting on a shared indexer's database on the event loop."""
        created = now_us()
        index, supersedes, retried = await self._assign_async(trajectory_id, attempt, created)
        return index, self._enqueue(self._call_entry(trajectory_id, row, index, created), supersedes), retried

    def commit_skip(self, trajectory_id: str, reason: str, attempt: Attempt | None = None) -> tuple[int, Future, bool]:
        """An answered but unrecordable call: it takes an index (or, as a retry, its earlier
        attempt's, whose row it retracts), no row is stored."""
        index, supersedes, retried = self._assign(trajectory_id, attempt, None)
        return index, self._enqueue(self._skip_entry(trajectory_id, reason, index), supersedes), retried

    async def commit_skip_async(self, trajectory_id: str, reason: str,
                                attempt: Attempt | None = None) -> tuple[int, Future, bool]:
        index, supersedes, retried = await self._assign_async(trajectory_id, attempt, None)
        return index, self._enqueue(self._skip_entry(trajectory_id, reason, index), supersedes), retried

    def commit_reward(self, trajectory_id: str, reward: float, source: str) -> tuple[int, Future]:
        created = now_us()
        row = {"trajectory_id": trajectory_id, "reward": float(reward), "source": source, "created_at": created}
        return created, self._submit({"kind": "reward", "row": row})

    # ------------------------------------------------------------------ threads

    def _write_loop(self) -> None:
        pending: list[dict] = []
        since = 0.0
        while True:
            with self._cond:
                while not (self._queue or self._stopping or self._flush_waiters):
                    wait = None
                    if pending and self.flush_interval_s > 0:
                        wait = max(since + self.flush_interval_s - time.monotonic(), 0.0)
                        if wait == 0.0:
                            break
                    self._cond.wait(wait)
                batch, self._queue = self._queue, []
                waiters, self._flush_waiters = self._flush_waiters, []
                stopping = self._stopping
            if batch:
                t0 = time.perf_counter()
                try:
                    self.wal.append(encode_entry(p.entry) for p in batch)
                except Exception as exc:  # nothing acknowledged; callers answer 503
                    self.stats.inc("wal_errors")
                    self._settle(batch, exc)
                else:
                    if not pending:
                        since = time.monotonic()
                    pending.extend(p.entry for p in batch)
                    t1 = time.perf_counter()
                    # time_us.wal_append / wal_fsyncs: mean encode + write + fdatasync of a group;
                    # time_us.wal_entry_wait / wal_appends: mean time an entry waited to be durable.
                    waits = [t1 - p.t for p in batch]
                    self.stats.add_many((("wal_appends", len(batch)), ("wal_fsyncs", 1),
                                         ("time_us.wal_append", int((t1 - t0) * 1e6)),
                                         ("time_us.wal_entry_wait", int(sum(waits) * 1e6))))
                    if self.on_group_commit is not None:
                        self.on_group_commit(t1 - t0, waits)
                    self._settle(batch, None)
            due = bool(pending) and (len(pending) >= self.flush_rows
                                     or time.monotonic() - since >= self.flush_interval_s)
            if pending and (due or waiters or stopping):
                sealed = self.wal.rotate()
                self._flushq.put(_Sealed(sealed, pending, waiters))
                pending, waiters = [], []
            if waiters:  # nothing pending: already flushed, but wait for earlier segments in the queue
                self._flushq.put(_Sealed(None, [], waiters))
            if stopping and not batch:
                with self._cond:
                    if not self._queue:
                        return

    def _settle(self, batch: list[_Pending], exc: BaseException | None) -> None:
        aio = [p.future for p in batch if isinstance(p.future, asyncio.Future)]
        for p in batch:
            if not isinstance(p.future, asyncio.Future):
                if exc is None:
                    p.future.set_result(True)
                else:
                    p.future.set_exception(exc)
        if aio:
            def settle() -> None:
                for f in aio:
                    if not f.done():
                        f.set_result(True) if exc is None else f.set_exception(exc)

            try:
                aio[0].get_loop().call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def _flush_loop(self) -> None:
        while True:
            item = self._flushq.get()
            if item is None:
                return
            delay, failures = 0.05, 0
            while True:
                try:
                    self._flush_sealed(item)
                    self.failing_since = None
                    break
                except Exception as exc:  # noqa: BLE001 - retried until it lands; said in the log
                    self.stats.inc("flush_errors")
                    failures += 1
                    if self.failing_since is None:
                        self.failing_since = time.monotonic()
                    self.last_flush_error = f"{type(exc).__name__}: {exc}"[:300]
                    if failures in (1, 10) or failures % 100 == 0:  # the first, then now and then
                        log.warning("flush of %d WAL entries failed (attempt %d, retrying): %s: %s",
                                    len(item.entries), failures, type(exc).__name__, exc)
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
            for ev in item.done:
                ev.set()

    def _flush_sealed(self, item: _Sealed) -> None:
        calls = [e["row"] for e in item.entries if e["kind"] == "call"]
        rewards = [e["row"] for e in item.entries if e["kind"] == "reward"]
        skips = [e for e in item.entries if e["kind"] == "skip"]
        retractions = [r for e in item.entries if (r := retraction_of(e)) is not None]
        if not item.entries:
            return
        seq = None if item.path is None else seq_of(item.path)
        if seq is not None and item.attempts:  # a retry: an earlier attempt may have committed (answer lost)
            done = self._committed(seq)
            calls, rewards, retractions = ([] if done[CALLS_T] else calls), ([] if done[REWARDS_T] else rewards), \
                ([] if done[RETRACTIONS_T] else retractions)
        item.attempts += 1
        self._write(calls, rewards, skips, retractions, seq=seq)
        if item.path is not None:
            self.wal.delete(item.path)
        self.stats.inc("flushed_calls", len(calls))
        self.stats.inc("flushed_rewards", len(rewards))
        self.stats.inc("flush_parts")

    def _committed(self, seq: int) -> dict[str, bool]:
        """Per table: did a commit carrying this log's segment ``seq`` (or a later one) land?"""
        wid = self.wal.writer_id()
        return {t: (self.store.tables.txn_version(t, wid) or 0) >= seq for t in (CALLS_T, REWARDS_T, RETRACTIONS_T)}

    def _write(self, calls: list[dict], rewards: list[dict], skips: list[dict], retractions: list[dict] = (),
               seq: int | None = None) -> None:
        # each table's commit carries (this log's id, segment number): replaying a segment is idempotent
        txn = None if seq is None else (self.wal.writer_id(), seq)
        if retractions:  # before the rows that supersede them: a crash between leaves a gap, not a conflict
            self.store.retract_calls(retractions, txn=txn)
        if calls:
            try:
                self.store.write_calls(calls, txn=txn)
            except SchemaMismatchError:
                self._write_one_by_one(calls, "calls", txn)
        if rewards:
            try:
                self.store.write_rewards(rewards, txn=txn)
            except SchemaMismatchError:
                self._write_one_by_one(rewards, "rewards", txn)
        if skips:
            payload = [{k: s[k] for k in ("trajectory_id", "call_index", "reason", "created_at")} for s in skips]
            write_skips(self.store.blobs, payload)

    def _write_one_by_one(self, rows: list[dict], kind: str, txn: tuple[str, int] | None = None) -> None:
        """A row that cannot be brought to its schema is set aside (JSON, counted: ``rejected_rows``),
        the rest stored: one bad row never stalls the flush of the others."""
        schema = CALL_SCHEMA if kind == "calls" else REWARD_SCHEMA
        good, bad = [], []
        for row in rows:
            try:
                to_table([row], schema)
                problem = name_problem(row.get("policy_version"), "policy_version") if kind == "calls" else None
                if problem:
                    raise SchemaMismatchError(problem)
                good.append(row)
            except SchemaMismatchError as exc:
                bad.append({"kind": kind, "row": row, "error": str(exc)})
        if good:
            (self.store.write_calls if kind == "calls" else self.store.write_rewards)(good, txn=txn)
        if bad:
            self.store.blobs.put_bytes(f"{REJECTED_PREFIX}part-{uuid7()}.json", json.dumps(bad).encode())
            self.stats.inc("rejected_rows", len(bad))

