"""The training op: in-process (CPU or one GPU) or `torchrun` through Dagster Pipes.

The subprocess client here; on Kubernetes use dagster-k8s's `PipesK8sClient` with the same
command in a pod that has the GPUs (and `--nnodes`/rendezvous flags for several nodes).
"""

import json
import os
import socket
import sys

from dagster import AssetExecutionContext, PipesSubprocessClient

from prodrl_pipelines.config import environment
from prodrl_pipelines.loop import train
from prodrl_pipelines.loop.services import Services


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(rkey: str, nproc: int, port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port or _free_port()),
            "-m", "prodrl_pipelines.ops.train_worker", "--round", rkey]


def train_op(context: AssetExecutionContext, svc: Services, rkey: str, nproc: int, settings_fields: dict,
             store_fields: dict, pipes: PipesSubprocessClient, on_step) -> dict:
    """Train the round; returns the stats of `train.train` (with per-step metrics under "steps")."""
    if nproc <= 1:
        return train.train(svc, rkey, on_step=on_step)
    env = {**os.environ, **environment.write(settings=settings_fields, store=store_fields), "PYTHONUNBUFFERED": "1"}
    inv = pipes.run(context=context, command=torchrun_command(rkey, nproc), env=env)
    mat = inv.get_materialize_result()
    md = {k: v.value for k, v in (mat.metadata or {}).items()}
    steps = json.loads(md.pop("steps_json"))
    global_step = int(md["global_step"]) - sum(1 for m in steps if not m.get("skipped"))
    for m in steps:  # report the per-step metrics as the in-process path does
        if not m.get("skipped"):
            global_step += 1
        on_step(global_step, m)
    return {**md, "steps": steps}
