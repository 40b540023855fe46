"""Run one step of a round as a Ray job, through dagster-ray's Pipes client.

The job (``ops.ray_jobs``) reports its result as a Pipes custom message; its stdout streams into the
Dagster step's logs. Cancelling the Dagster run stops the Ray job (``forward_termination``).
"""

from __future__ import annotations

from collections.abc import Mapping

from dagster import OpExecutionContext
from dagster_ray import PipesRayJobClient

from prodrl_pipelines.cluster.config import ClusterSettings
from prodrl_pipelines.cluster.jobs import submit_params


class RayJobFailed(RuntimeError):
    """The step's Ray job ended without a result (the message says why)."""


def run_ray_step(context: OpExecutionContext, cluster: ClusterSettings, step: str, args: list[str],
                 settings_fields: Mapping, store_fields: Mapping, name: str,
                 extra_env: Mapping | None = None) -> dict:
    """Submit ``step`` as a Ray job, stream its logs, and return the dict the job reported."""
    client = PipesRayJobClient(address=cluster.cluster_address, poll_interval=0.5, forward_termination=True)
    params = submit_params(cluster, step, args, settings_fields, store_fields, name, extra_env)
    try:
        inv = client.run(context=context, submit_job_params=params)
    except BaseException:
        # cancelled (Dagster's interrupt, a Ctrl-C that reached this process as KeyboardInterrupt) or
        # the wait itself failed: the job must not go on training without its step
        _stop(context, cluster, params["submission_id"])
        raise
    results = [m["result"] for m in inv.get_custom_messages() if isinstance(m, dict) and "result" in m]
    if not results:
        raise RayJobFailed(f"Ray job {params['submission_id']} ({step}) at {cluster.cluster_address} reported no result")
    return results[-1]


def _stop(context: OpExecutionContext, cluster: ClusterSettings, submission_id: str) -> None:
    from ray.job_submission import JobSubmissionClient

    try:
        if JobSubmissionClient(cluster.cluster_address).stop_job(submission_id):
            context.log.warning(f"stopped Ray job {submission_id}: its step ended before it did")
    except Exception as e:  # noqa: BLE001 - the step's own error is the one to raise
        context.log.error(f"could not stop Ray job {submission_id} at {cluster.cluster_address}: {e}")
