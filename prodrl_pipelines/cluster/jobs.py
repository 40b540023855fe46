"""What a Ray job of a round is: its entrypoint command and its runtime env (no Ray, no Dagster).

Every job runs ``python -m prodrl_pipelines.ops.ray_jobs STEP ARGS`` on the cluster's head; the
step learns its settings and stores from the same ``PRODRL_*`` variables as a torchrun rank
(``config.environment``), carried in the job's runtime env beside the user's own
(``cluster_runtime_env``). On a real cluster the store is S3, so any node reads and writes it.
"""

from __future__ import annotations

import shlex
import sys
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
