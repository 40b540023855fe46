"""A round's held-out evaluation as a Ray job: the episodes sharded over Ray workers.

    python -m prodrl_pipelines.ops.ray_jobs evaluate --round round-000007

The job's driver (on the cluster's head) runs the round's evaluation step (``loop.evaluate``: the
candidate, the live policy, the reference policy of the cumulative monitors) with a Ray episode
runner (``evaluation.ray_runner``: ``cluster_eval_workers`` actors of ``cluster_cpus_per_worker``
CPUs, each with its own engine), records it in the store as the in-process step does, and returns
the step's result. The KL to live scores the candidate's calls on the driver, as in-process.

``heldout_eval_op`` is the Dagster side: this job through dagster-ray's Pipes client when the
cluster settings ask for Ray evaluation workers, else the step in the step's own process.
"""

from __future__ import annotations

import argparse
import re

from prodrl_pipelines.evaluation.runners import EvalShardError, make_runner, runner_for


def evaluate_job(argv: list[str]) -> dict:
    """Evaluate the round on the job's Ray cluster; returns ``loop.evaluate.evaluate``'s result."""
    from prodrl_pipelines.cluster.config import cluster_settings
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.loop import evaluate
    from prodrl_pipelines.loop.services import services_from_env

    ap = argparse.ArgumentParser(prog="ray_jobs evaluate")
    ap.add_argument("--round", required=True)
    args = ap.parse_args(argv)
    flat = environment.read_settings()
    svc = services_from_env(flat)
    svc.episode_runner = make_runner(cluster_settings(flat), "ray")
    try:
        return evaluate.evaluate(svc, args.round)
    finally:
        svc.episode_runner.close()


# the failed shard's sentence, at the end of the job's log tail (Ray's job message)
_SHARD_FAILED = re.compile(rf"{EvalShardError.__name__}: (.+)")


def heldout_eval_op(context, svc, rkey: str, cluster, settings_fields: dict, store_fields: dict) -> dict:
    """The round's held-out evaluation: on Ray workers (a Ray job) when ``cluster`` asks for them,
    else in this process. A decided round reproduces its recorded evaluation here, without a job."""
    from prodrl_pipelines.loop import evaluate

    if runner_for(cluster) == "in_process" or svc.ledger.decision(rkey) is not None:
        return evaluate.evaluate(svc, rkey)
    from dagster import Failure

    from prodrl_pipelines.ops.ray_launch import run_ray_step

    try:
        return run_ray_step(context, cluster, "evaluate", ["--round", rkey], settings_fields, store_fields,
                            name=f"eval-{rkey}")
    except RuntimeError as e:  # the job failed: name the shard rather than quote the whole log
        found = _SHARD_FAILED.findall(str(e))
        if not found:
            raise
        raise Failure(description=found[-1], metadata={"ray_job_error": str(e)[-4000:]}) from None
