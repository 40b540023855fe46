"""What a Ray job of a round is: its entrypoint command and its runtime env (no Ray, no Dagster).

Every job runs ``python -m prodrl_pipelines.ops.ray_jobs STEP ARGS`` on the cluster's head; the
step learns its settings and stores from the same ``PRODRL_*`` variables as a torchrun rank
(``config.environment``), carried in the job's runtime env beside the user's own
(``cluster_runtime_env``). On a real cluster the store is S3, so any node reads and writes it.
A Dagster step launches the job through dagster-ray (``ops.ray_launch``); a command outside Dagster
(``prodrl rewards rescore``) with ``run_job``, reading the result from the one JSON line the job
prints last. Interrupting the command stops the job.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
import uuid
from collections.abc import Mapping

from prodrl_pipelines.cluster.config import ClusterSettings
from prodrl_pipelines.config import environment
from prodrl_pipelines.cluster.local import LOOPBACK_ENV


def entrypoint(cluster: ClusterSettings, step: str, args: list[str]) -> str:
    python = cluster.cluster_python or sys.executable
    return shlex.join([python, "-m", "prodrl_pipelines.ops.ray_jobs", step, *args])


def runtime_env(cluster: ClusterSettings, settings_fields: Mapping, store_fields: Mapping,
                extra_env: Mapping | None = None) -> dict:
    """The user's runtime env with the ``PRODRL_*`` variables (and the loopback switch, which a
    driver on a multi-node local cluster needs like the nodes) added to its ``env_vars``."""
    env = dict(cluster.runtime_env())
    env_vars = {**LOOPBACK_ENV, **environment.write(settings=dict(settings_fields), store=dict(store_fields)),
                "PYTHONUNBUFFERED": "1", **(extra_env or {}), **env.get("env_vars", {})}
    return {**env, "env_vars": {k: str(v) for k, v in env_vars.items()}}


def submit_params(cluster: ClusterSettings, step: str, args: list[str], settings_fields: Mapping,
                  store_fields: Mapping, name: str, extra_env: Mapping | None = None) -> dict:
    """``JobSubmissionClient.submit_job`` keyword arguments of one step's job."""
    return {"entrypoint": entrypoint(cluster, step, args),
            "runtime_env": runtime_env(cluster, settings_fields, store_fields, extra_env),
            "submission_id": f"prodrl-{name}-{uuid.uuid4().hex[:8]}"}


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
            name: str, *, timeout_s: float = 24 * 3600, poll_s: float = 0.5, log=None) -> dict:
    """Run ``step`` as a Ray job on ``cluster`` and return the dict it reported (progress on ``log``,
    default the current ``sys.stderr``)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    log = log or sys.stderr

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
