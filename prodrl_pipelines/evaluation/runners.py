"""Who plays a held-out evaluation's episodes: this process, or workers on a Ray cluster.

Every runner plays the batches of ``batches.EpisodeWork`` (why the batch is the unit: ``batches``)
and returns the episodes in task order, the same whoever played them. ``RUNNERS`` maps a name to a
factory taking the cluster settings (``cluster.config``); ``runner_for`` picks the name from them:
``ray`` with ``cluster: ray`` and ``cluster_eval_workers >= 1``, else ``in_process``. A runner's
``play(work)`` returns the episodes; ``close()`` frees what it holds.
"""

from __future__ import annotations

from typing import Callable

from prodrl_pipelines.evaluation.batches import EngineCache, EpisodeWork, EvalShardError, play_batch
from prodrl_pipelines.evaluation.episodes import PlayedEpisode, stop_token_ids

__all__ = ["RUNNERS", "EpisodeWork", "EvalShardError", "InProcessRunner", "make_runner", "runner_for"]


class InProcessRunner:
    """Every batch in this process, one after the other, on one engine per export."""

    def __init__(self) -> None:
        self._cache = EngineCache()

    @classmethod
    def from_cluster(cls, cluster=None) -> InProcessRunner:
        return cls()

    def play(self, work: EpisodeWork, engine=None, stops: tuple[int, ...] | None = None) -> list[PlayedEpisode]:
        """``engine`` (with ``stops``): play on it (an endpoint client) instead of the local engine."""
        if engine is None:
            engine, stops = self._cache.get(work.export_dir)
        elif stops is None:
            stops = stop_token_ids(engine.tokenizer, work.export_dir)
        return [ep for b in range(len(work.batches())) for ep in play_batch(engine, stops, work, b)]

    def close(self) -> None:
        self._cache = EngineCache()


def _ray_runner(cluster):
    from prodrl_pipelines.evaluation.ray_runner import RayEpisodeRunner

    return RayEpisodeRunner.from_cluster(cluster)


RUNNERS: dict[str, Callable] = {"in_process": InProcessRunner.from_cluster, "ray": _ray_runner}


def runner_for(cluster) -> str:
    """The runner the cluster settings ask for (``None``: no cluster settings, this process)."""
    on_ray = cluster is not None and cluster.on_ray and cluster.cluster_eval_workers >= 1
    return "ray" if on_ray else "in_process"


def make_runner(cluster=None, name: str | None = None):
    """The runner named ``name`` (default: ``runner_for(cluster)``), built from the cluster settings."""
    name = name or runner_for(cluster)
    if name not in RUNNERS:
        raise ValueError(f"unknown episode runner {name!r}; known: {', '.join(sorted(RUNNERS))}")
    return RUNNERS[name](cluster)
