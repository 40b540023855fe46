"""Concurrent requests batched into engine calls: requests that arrive close together share one generate()."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prodrl_pipelines.engines.types import CallRecord, SamplingParams


# ----------------------------------------------------------------------------- batching


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    seed: int | None
    future: asyncio.Future
    queued_at: float = 0.0  # perf_counter when it was queued
    model: str | None = None  # a LoRA adapter's name (None: the base)


@dataclass
class BatcherStats:
    requests: int = 0
    generate_calls: int = 0
    prompts: int = 0


class EngineBatcher:
    """Collects concurrent generation requests and runs them through one engine thread.

    ``engine`` is anything with ``generate(prompts, params, seed) -> list[CallRecord]``. After the
    first request of a batch the loop keeps collecting until ``quiet_gap_ms`` pass without a new
    request, ``batch_wait_ms`` in all, or ``max_batch_size`` prompts; unseeded jobs with equal
    ``SamplingParams`` then share one ``generate`` call, a seeded job always runs alone. Requests
    that arrive while the engine is busy are all taken by the next batch. Jobs for a LoRA adapter
    (``adapters``: name -> ``serve_adapters.Adapter``) run on its engine, batched only with its own.
    """

    def __init__(self, engine, batch_wait_ms: float = 10.0, max_batch_size: int = 64, quiet_gap_ms: float = 1.0) -> None:
        self.engine = engine
        self.adapters: dict = {}  # changed on the engine thread only (between batches)
        self.batch_wait_s = max(float(batch_wait_ms), 0.0) / 1000.0
        self.quiet_gap_s = max(float(quiet_gap_ms), 0.0) / 1000.0
        self.max_batch_size = max(int(max_batch_size), 1)
        self.stats = BatcherStats()
        self.metrics = None  # serve_metrics.ServeMetrics: told when jobs queue, start and end
        self._executor: ThreadPoolExecutor | None = None
        self._queue: asyncio.Queue[_Job] | None = None
        self._task: asyncio.Task | None = None

    @property
    def task(self) -> asyncio.Task | None:
        """The batching loop (None before ``start``): readiness asks whether it still runs."""
        return self._task

    @property
    def pending(self) -> int:
        """Jobs queued and not yet taken by the batching loop."""
        return 0 if self._queue is None else self._queue.qsize()

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prodrl-engine")
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._queue = None

    async def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
                       model: str | None = None) -> list[CallRecord]:
        if self._queue is None:
            raise RuntimeError("EngineBatcher.start() was not called")
        fut = asyncio.get_running_loop().create_future()
        self.stats.requests += 1
        if self.metrics is not None:
            self.metrics.queued(len(prompts))
        await self._queue.put(_Job(prompts, params, seed, fut, time.perf_counter(), model))
        return await fut

    async def call(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread (after any batch in progress)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            jobs = [first]
            size = len(first.prompts)

            def drain() -> int:
                nonlocal size
                got = 0
                while size < self.max_batch_size:
                    try:
                        job = self._queue.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    jobs.append(job)
                    size += len(job.prompts)
                    got += 1
                return got

            drain()
            if self.batch_wait_s > 0 and first.seed is None:
                # Keep collecting while requests keep coming: stop after a quiet gap with no new
                # request, a full batch, or batch_wait in all.
                deadline = loop.time() + self.batch_wait_s
                while size < self.max_batch_size and loop.time() < deadline:
                    await asyncio.sleep(min(self.quiet_gap_s, max(deadline - loop.time(), 0.0)))
                    if drain() == 0:
                        break
            groups: dict[Any, list[_Job]] = {}
            for job in jobs:
                key = ("params", job.model, job.params) if job.seed is None else ("seeded", id(job))
                groups.setdefault(key, []).append(job)
            for group in groups.values():
                prompts = [p for j in group for p in j.prompts]
                params, seed, model = group[0].params, group[0].seed, group[0].model
                self.stats.generate_calls += 1
                self.stats.prompts += len(prompts)
                t0 = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.batch_started(len(prompts), [t0 - j.queued_at for j in group for _ in j.prompts])
                try:
                    records = await loop.run_in_executor(self._executor, self._generate, prompts, params, seed, model)
                except Exception as exc:  # the group's requests fail; the loop keeps serving
                    if self.metrics is not None:
                        self.metrics.batch_failed(len(prompts))
                    for j in group:
                        if not j.future.done():
                            j.future.set_exception(exc)
                    continue
                if self.metrics is not None:
                    self.metrics.batch_done(len(prompts), time.perf_counter() - t0, records)
                at = 0
                for j in group:
                    if not j.future.done():
                        j.future.set_result(records[at : at + len(j.prompts)])
                    at += len(j.prompts)

    def _generate(self, prompts, params, seed, model=None):
        engine = self.engine
        if model is not None:
            adapter = self.adapters.get(model)
            if adapter is None:  # unloaded while the call waited
                raise ValueError(f"The model `{model}` does not exist.")
            engine = adapter.engine
        return engine.generate(prompts, params, seed=seed)
