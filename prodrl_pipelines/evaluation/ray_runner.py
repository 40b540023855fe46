"""Held-out episodes on a Ray cluster: a pool of actors, each with its own local engine.

Each actor reserves ``cluster_cpus_per_worker`` CPUs (spread over the nodes), runs torch on that
many threads (at least one), and keeps the engines it loaded: the export at the path the driver names
when the node holds it there (a shared disk), else a verified copy fetched from the exports store
on S3 into the node's cache (``deploy_targets.node_exports``, as a fleet's replicas fetch theirs). The batches
of ``batches.EpisodeWork`` go to whichever actor is free, and the episodes come back in batch order,
so the merged evaluation is the in-process one (``batches``: why the batch is the unit).

The pool stays up between ``play`` calls (the candidate's and the live policy's evaluations share
it, and a benchmark keeps it warm); ``prepare(export_dir)`` loads the engine on every actor ahead
of the first batch. ``close()`` kills the actors; the Ray connection is the caller's.
"""

from __future__ import annotations

import logging
from collections import deque

from prodrl_pipelines.evaluation.batches import EngineCache, EpisodeWork, EvalShardError, play_batch

log = logging.getLogger(__name__)


class EpisodeWorker:
    """The actor (wrapped by ``ray.remote`` when the pool starts): plays batches on its engines."""

    def __init__(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self._cache = EngineCache()
        self._located: dict[str, str] = {}  # export path the driver names -> where this node holds it

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def _engine(self, export_dir: str, source: dict | None):
        from prodrl_pipelines.deploy_targets.node_exports import locate

        try:
            if export_dir not in self._located:  # once per export: a cached copy is checked in full
                self._located[export_dir] = locate(export_dir, source)
            return self._cache.get(self._located[export_dir])
        except Exception as e:  # noqa: BLE001 - said with the path, whatever the loader raised
            raise RuntimeError(f"cannot load the policy at {export_dir}: {type(e).__name__}: {e}") from e

    def load(self, export_dir: str, source: dict | None = None) -> bool:
        self._engine(export_dir, source)
        return True

    def play(self, work: EpisodeWork, b: int, source: dict | None = None) -> list:
        engine, stops = self._engine(work.export_dir, source)
        return play_batch(engine, stops, work, b)


def _source(export_dir: str) -> dict | None:
    """Where the nodes fetch ``export_dir`` from when their disk lacks it: the exports store on S3 of
    this process's environment (a Ray job's runtime env carries it); None for a local store."""
    from prodrl_pipelines.deploy_targets.node_exports import export_source

    return export_source(None, export_dir)


def _cause(e: Exception) -> str:
    """The worker's own error (a Ray task error wraps it with Ray's traceback)."""
    inner = getattr(e, "cause", None)
    return f"{type(inner).__name__}: {inner}" if isinstance(inner, BaseException) else f"{type(e).__name__}: {e}"


class RayEpisodeRunner:
    """``workers`` actors of ``cpus_per_worker`` CPUs each on the connected Ray cluster (``ray.init``
    with ``address`` when this process is not connected yet: ``auto`` inside a Ray job)."""

    def __init__(self, workers: int = 2, cpus_per_worker: float = 1.0, address: str | None = None,
                 start_timeout_s: float = 300.0) -> None:
        if workers < 1:
            raise ValueError(f"a Ray episode runner needs at least one worker, got {workers}")
        self.workers, self.cpus_per_worker, self.address = workers, cpus_per_worker, address
        self.start_timeout_s = start_timeout_s
        self._actors: list = []
        self.nodes: list[str] = []  # node id of each actor
        self.placement: list[tuple[int, int]] = []  # (batch, actor) of the last play, in completion order

    @classmethod
    def from_cluster(cls, cluster) -> RayEpisodeRunner:
        return cls(workers=cluster.cluster_eval_workers, cpus_per_worker=cluster.cluster_cpus_per_worker)

    def _start(self) -> None:
        import ray

        if self._actors:
            return
        if not ray.is_initialized():
            ray.init(address=self.address or "auto", log_to_driver=False)
        worker = ray.remote(EpisodeWorker)
        threads = max(1, int(self.cpus_per_worker))
        actors = [worker.options(num_cpus=self.cpus_per_worker, scheduling_strategy="SPREAD").remote(threads)
                  for _ in range(self.workers)]
        refs = [a.node.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
        if len(ready) < len(refs):
            for a in actors:
                ray.kill(a)
            raise EvalShardError(f"{len(refs) - len(ready)} of {self.workers} evaluation workers "
                                 f"({self.cpus_per_worker:g} CPUs each) did not start on the Ray cluster within "
                                 f"{self.start_timeout_s:.0f} s (cluster resources: {ray.cluster_resources()})")
        self.nodes = ray.get(refs)
        self._actors = actors

    def prepare(self, export_dir: str) -> None:
        """Start the pool and load ``export_dir``'s engine on every actor (in parallel)."""
        import ray

        self._start()
        source = _source(str(export_dir))
        refs = {a.load.remote(str(export_dir), source): w for w, a in enumerate(self._actors)}
        for ref, w in refs.items():
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a Ray task or actor error: name the worker
                raise EvalShardError(f"Ray evaluation worker {w} (node {self.nodes[w][:12]}): {_cause(e)}") from None

    def play(self, work: EpisodeWork) -> list:
        """Every batch of ``work`` on the pool, merged in batch (so task) order."""
        import ray

        self._start()
        batches = work.batches()
        if len(batches) < len(self._actors):
            log.warning(f"{len(batches)} episode batch(es) for {len(self._actors)} Ray evaluation workers: "
                        f"{len(self._actors) - len(batches)} idle (eval.episode_batch sets the batch size; it "
                        "is part of what the evaluation samples, like its seed)")
        ref, source = ray.put(work), _source(work.export_dir)
        todo, free = deque(range(len(batches))), deque(range(len(self._actors)))
        pending: dict = {}
        results: list = [None] * len(batches)
        self.placement = []
        while todo or pending:
            while todo and free:
                b, w = todo.popleft(), free.popleft()
                pending[self._actors[w].play.remote(ref, b, source)] = (b, w)
            [done], _ = ray.wait(list(pending), num_returns=1)
            b, w = pending.pop(done)
            try:
                results[b] = ray.get(done)
            except Exception as e:  # noqa: BLE001 - a Ray task or actor error: name the shard
                for other in pending:  # queued batches are dropped; a running one ends on its own
                    try:
                        ray.cancel(other)
                    except Exception:  # noqa: BLE001, S110 - best effort: the error below is what counts
                        pass
                raise EvalShardError(f"{work.describe(b)} failed on Ray evaluation worker {w} "
                                     f"(node {self.nodes[w][:12]}): {_cause(e)}") from None
            self.placement.append((b, w))
            free.append(w)
        return [ep for r in results for ep in r]

    def close(self) -> None:
        import ray

        for a in self._actors:
            ray.kill(a)
        self._actors, self.nodes = [], []

    def __enter__(self) -> RayEpisodeRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
