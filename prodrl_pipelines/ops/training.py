"""The training op: in-process (CPU or one GPU), `torchrun` through Dagster Pipes, or a Ray Train
job through dagster-ray's Pipes client (``cluster: ray``).

The subprocess client here; on Kubernetes use dagster-k8s's `PipesK8sClient` with the same
command in a pod that has the GPUs (and `--nnodes`/rendezvous flags for several nodes), or a Ray
cluster (KubeRay) with ``cluster: ray``.
"""

import json
import os
import socket
import sys

from dagster import AssetExecutionContext, Failure, PipesSubprocessClient

from prodrl_pipelines.cluster.config import ClusterSettings
from prodrl_pipelines.config import environment
from prodrl_pipelines.loop import train
from prodrl_pipelines.loop.services import Services
from prodrl_pipelines.storage import documents, keys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(rkey: str, nproc: int, port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port or _free_port()),
            "-m", "prodrl_pipelines.ops.train_worker", "--round", rkey]


def _torchrun(context, rkey: str, nproc: int, settings_fields: dict, store_fields: dict,
              pipes: PipesSubprocessClient) -> dict:
    env = {**os.environ, **environment.write(settings=settings_fields, store=store_fields), "PYTHONUNBUFFERED": "1"}
    inv = pipes.run(context=context, command=torchrun_command(rkey, nproc), env=env)
    mat = inv.get_materialize_result()
    return {k: v.value for k, v in (mat.metadata or {}).items()}


def _ray(context, svc: Services, rkey: str, cluster: ClusterSettings, settings_fields: dict,
         store_fields: dict) -> dict:
    from prodrl_pipelines.ops.ray_launch import run_ray_step

    svc.blobs.delete(keys.train_failure(rkey), missing_ok=True)
    try:
        out = run_ray_step(context, cluster, "train", ["--round", rkey], settings_fields, store_fields,
                           name=f"train-{rkey}")
    except RuntimeError as e:  # the job failed: name the worker (the job recorded which) rather than quote the log
        if not svc.blobs.exists(keys.train_failure(rkey)):
            raise
        failure = documents.get_json(svc.blobs, keys.train_failure(rkey))
        # not retried here: Ray Train's failure_config is where a cluster retries; a person looks
        # first, unless Ray took the workers' resources away from under a healthy training
        raise Failure(description=f"{failure['message']} (re-materialise to resume from the in-round checkpoint)",
                      metadata={"ray_job_error": str(e)[-4000:]}, allow_retries=bool(failure.get("retry"))) from None
    return dict(out["metadata"])


def train_op(context: AssetExecutionContext, svc: Services, rkey: str, nproc: int, settings_fields: dict,
             store_fields: dict, pipes: PipesSubprocessClient, on_step,
             cluster: ClusterSettings | None = None) -> dict:
    """Train the round; returns the stats of `train.train` (with per-step metrics under "steps")."""
    if cluster is not None and cluster.on_ray:
        md = _ray(context, svc, rkey, cluster, settings_fields, store_fields)
    elif nproc <= 1:
        return train.train(svc, rkey, on_step=on_step)
    else:
        md = _torchrun(context, rkey, nproc, settings_fields, store_fields, pipes)
    steps = json.loads(md.pop("steps_json"))
    global_step = int(md["global_step"]) - sum(1 for m in steps if not m.get("skipped"))
    for m in steps:  # report the per-step metrics as the in-process path does
        if not m.get("skipped"):
            global_step += 1
        on_step(global_step, m)
    return {**md, "steps": steps}
