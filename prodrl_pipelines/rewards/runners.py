"""Where a reward source scores the trajectories of one job (``SCORING_RUNNERS``, by name):

- ``local``: in this process, with the source's own threads (a judge keeps ``judge_concurrency``
  requests in flight);
- ``ray``: a Ray Data actor pool of ``workers`` scorers on the Ray cluster this process drives
  (``rewards.ray_scoring``); each actor builds the source from the settings and keeps at most
  ``judge_concurrency`` judge requests in flight.

Both answer one outcome per trajectory in the order given, so the rows a job writes are the same
whichever ran it. Reading and the one commit per job stay with the caller (``rewards.scoring``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from prodrl_pipelines.rewards.outcome import Outcome
from prodrl_pipelines.rewards.view import TrajectoryView


@dataclass(frozen=True)
class Runner:
    name: str = "local"
    workers: int = 0  # Ray Data scorer actors (``ray``)
    # what the last source run reported (``ray``: batches, batch size, the actors that scored)
    stats: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.name not in SCORING_RUNNERS:
            raise ValueError(f"unknown scoring runner {self.name!r}; known: {', '.join(sorted(SCORING_RUNNERS))}")
        if self.name == "ray" and self.workers < 1:
            raise ValueError(f"the ray scoring runner needs at least one worker, got {self.workers}")


def score_here(runner: Runner, name: str, src, views: Sequence[TrajectoryView], settings,
               progress: Callable | None = None) -> list[Outcome]:
    return src.score(views, progress=progress)


def score_on_ray(runner: Runner, name: str, src, views: Sequence[TrajectoryView], settings,
                 progress: Callable | None = None) -> list[Outcome]:
    from prodrl_pipelines.rewards.ray_scoring import score_on_ray as run

    return run(name, src.version, views, settings, runner.workers, progress, runner.stats)


SCORING_RUNNERS: dict[str, Callable[..., list[Outcome]]] = {"local": score_here, "ray": score_on_ray}
LOCAL = Runner()


def run_source(runner: Runner, name: str, src, views: Sequence[TrajectoryView], settings,
               progress: Callable | None = None) -> list[Outcome]:
    """``src`` (source ``name`` of ``settings``, a ``RewardSettings``) on ``views``, where ``runner`` says."""
    if not views:
        return []
    return SCORING_RUNNERS[runner.name](runner, name, src, views, settings, progress)


def runner_for(cluster) -> Runner:
    """The runner a job's cluster settings (``cluster.config.ClusterSettings``) ask for: Ray Data
    with ``cluster_scoring_workers`` actors on a ``ray`` cluster when that is above 0, else here."""
    if cluster.on_ray and cluster.cluster_scoring_workers > 0:
        return Runner("ray", cluster.cluster_scoring_workers)
    return LOCAL
