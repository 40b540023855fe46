"""A command's step as a Ray job, outside Dagster: submitted to the cluster's dashboard with Ray's
``JobSubmissionClient`` (the same entrypoint and runtime env as a Dagster step's, ``cluster.jobs``),
waited for, and its result read from the one JSON line the job prints last (``ops.ray_jobs``).
Interrupting the command stops the job.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping

from prodrl_pipelines.cluster.config import ClusterSettings
from prodrl_pipelines.cluster.jobs import submit_params


class RayJobError(RuntimeError):
    """The job ended without a result; the message names it and ends with its log's tail."""


def result_of(logs: str) -> dict | None:
    """The last line of ``logs`` that is a JSON object."""
    for line in reversed(logs.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def run_job(cluster: ClusterSettings, step: str, args: list[str], settings_fields: Mapping, store_fields: Mapping,
            name: str, *, timeout_s: float = 24 * 3600, poll_s: float = 0.5, log=sys.stderr) -> dict:
    """Run ``step`` as a Ray job on ``cluster`` and return the dict it reported."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.cluster_address)
    params = submit_params(cluster, step, args, settings_fields, store_fields, name)
    job_id = client.submit_job(**params)
    print(f"prodrl: Ray job {job_id} ({step}) submitted to {cluster.cluster_address}", file=log)
    deadline = time.monotonic() + timeout_s
    try:
        while (status := client.get_job_status(job_id)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                                   JobStatus.STOPPED):
            if time.monotonic() > deadline:
                client.stop_job(job_id)
                raise RayJobError(f"Ray job {job_id} ({step}) still {status} after {timeout_s:.0f}s: stopped")
            time.sleep(poll_s)
    except KeyboardInterrupt:
        client.stop_job(job_id)
        raise
    logs = client.get_job_logs(job_id)
    out = result_of(logs) if status == JobStatus.SUCCEEDED else None
    if out is None:
        raise RayJobError(f"Ray job {job_id} ({step}) at {cluster.cluster_address} ended {status} without a "
                          f"result; its log ends:\n{logs[-3000:]}")
    return out
