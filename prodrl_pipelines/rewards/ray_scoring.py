"""Scoring on a Ray Data actor pool (the ``ray`` runner of ``rewards.runners``).

The trajectories go to the cluster as Arrow blocks (one row per trajectory: its outputs and
prompts as lists), ``map_batches`` sends them through ``workers`` scorer actors, and the outcomes
come back to the driver in the order sent. Each actor builds the configured source itself from the
reward settings (a grader imported on its node, a judge with its own HTTP client and at most
``judge_concurrency`` requests in flight), and refuses to start when its source's version differs
from the driver's (other grader code on the cluster would write rows under the wrong version).

Reading and committing stay with the caller, through the store's own code (``rewards.scoring``):
the store reads in write order with de-duplication and retractions, and Ray Data's Delta writer
(2.60) commits without an application transaction, which the one commit per job needs.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Sequence

import pyarrow as pa

from prodrl_pipelines.rewards.outcome import Outcome
from prodrl_pipelines.rewards.view import TrajectoryView

VIEW_SCHEMA = pa.schema([
    pa.field("_i", pa.int64()), pa.field("trajectory_id", pa.string()), pa.field("task_id", pa.string()),
    pa.field("outputs", pa.list_(pa.string())), pa.field("prompts", pa.list_(pa.string())),
    pa.field("policy_version", pa.string()), pa.field("num_calls", pa.int64()),
])
OUTCOME_SCHEMA = pa.schema([pa.field("_i", pa.int64()), pa.field("reward", pa.float64()),
                            pa.field("error", pa.string()), pa.field("worker", pa.string())])
BATCHES_PER_WORKER = 4  # enough batches that an actor finishing early takes another
MAX_BATCH = 2000


class ScorerVersionMismatch(RuntimeError):
    """A scorer actor's source is not the version the driver would write its rows under."""


def views_table(views: Sequence[TrajectoryView]) -> pa.Table:
    return pa.table({
        "_i": list(range(len(views))), "trajectory_id": [v.trajectory_id for v in views],
        "task_id": [v.task_id for v in views], "outputs": [list(v.outputs) for v in views],
        "prompts": [list(v.prompts) for v in views],
        "policy_version": [v.metadata.get("policy_version") for v in views],
        "num_calls": [v.metadata.get("num_calls", len(v.outputs)) for v in views],
    }, schema=VIEW_SCHEMA)


def views_of(batch: pa.Table) -> list[TrajectoryView]:
    """The views of a ``views_table`` batch, as ``views_from_calls`` built them on the driver."""
    cols = {c: batch.column(c).to_pylist() for c in VIEW_SCHEMA.names}
    return [TrajectoryView(trajectory_id=t, task_id=task, outputs=tuple(o), prompts=tuple(p),
                           metadata={"policy_version": pv, "num_calls": n})
            for t, task, o, p, pv, n in zip(cols["trajectory_id"], cols["task_id"], cols["outputs"], cols["prompts"],
                                            cols["policy_version"], cols["num_calls"])]


class Scorer:
    """One actor of the pool: the source built once, then one batch of trajectories per call."""

    def __init__(self, name: str, settings_fields: dict, version: str | None) -> None:
        import socket

        from prodrl_pipelines.rewards.config import RewardSettings
        from prodrl_pipelines.rewards.sources import make_source

        self.src = make_source(name, RewardSettings(**settings_fields))
        if self.src.version != version:
            raise ScorerVersionMismatch(
                f"the {name} source on {socket.gethostname()} is {self.src.version!r}, the driver's is {version!r}: "
                f"the cluster runs other code than the driver (install the same grader on every node)")
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: pa.Table) -> pa.Table:
        outcomes = self.src.score(views_of(batch))
        return pa.table({"_i": batch.column("_i"), "reward": [o.reward for o in outcomes],
                         "error": [o.error for o in outcomes], "worker": [self.worker] * len(outcomes)},
                        schema=OUTCOME_SCHEMA)


WAIT_FOR_ACTORS_S = 300


def batch_size(rows: int, workers: int, settings) -> int:
    """About ``BATCHES_PER_WORKER`` batches per actor, each big enough to keep a judge's
    ``judge_concurrency`` requests in flight."""
    per = math.ceil(rows / (workers * BATCHES_PER_WORKER))
    return max(1, min(MAX_BATCH, max(per, 2 * settings.judge_concurrency)))


def connect() -> None:
    """Join the cluster this process is a driver of: a Ray job's own (``RAY_ADDRESS``), or one
    already initialised; never a new local one."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)


def score_on_ray(name: str, version: str | None, views: Sequence[TrajectoryView], settings, workers: int,
                 progress: Callable | None = None, stats: dict | None = None) -> list[Outcome]:
    """Outcomes of source ``name`` (``settings``: ``RewardSettings``) on ``views``, in order, scored by
    ``workers`` actors. ``stats`` (optional) gets the batches and the actors that scored them."""
    import ray

    connect()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    # Ray Data hands batches to a pool's first ready actor while the others still import (its default
    # -1 does not wait): one actor could score everything. Wait for the whole pool; a cluster without
    # room for it fails after this long instead of waiting forever.
    ctx.wait_for_min_actors_s = WAIT_FOR_ACTORS_S
    table = views_table(views)
    bs = batch_size(table.num_rows, workers, settings)
    blocks = [table.slice(i, bs) for i in range(0, table.num_rows, bs)]
    ds = ray.data.from_arrow(blocks).map_batches(
        Scorer, fn_constructor_args=(name, settings.model_dump(), version), batch_size=bs,
        batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1)
    parts = []
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        parts.append(batch)
        if progress is not None:
            progress(batch.num_rows)
    out = pa.concat_tables(parts).sort_by("_i") if parts else OUTCOME_SCHEMA.empty_table()
    if out.num_rows != len(views) or out.column("_i").to_pylist() != list(range(len(views))):
        raise RuntimeError(f"Ray Data scoring answered {out.num_rows} outcomes for {len(views)} trajectories")
    if stats is not None:
        stats.update(batches=len(blocks), batch_size=bs, workers=sorted(set(out.column("worker").to_pylist())))
    return [Outcome(r, e) for r, e in zip(out.column("reward").to_pylist(), out.column("error").to_pylist())]
