"""Training worker launched by `torchrun` (through Dagster Pipes) for one round.

    torchrun --nproc_per_node N -m prodrl_pipelines.ops.train_worker --round round-000007

The policy is sharded with FSDP2 (``rl.sharding``: each decoder layer and the root; parameters,
gradients and Adam state split over the ranks; gloo on CPU, nccl on GPUs). Each rank trains its
shard of every minibatch, the gradients are reduce-scattered as a sum, so every rank takes its
part of the same Adam step; the round's checkpoint is gathered whole and written by rank 0. Settings
come from the environment exactly as for the code location (PRODRL_SETTINGS_JSON, PRODRL_STORE_ROOT).
Rank 0 reports metrics and the checkpoint path back to Dagster through Pipes when launched by a Pipes
client, and runs standalone otherwise.

``run_rank`` is one rank's whole body, shared with the Ray Train workers (``ops.ray_train``): the
launcher (torchrun here, Ray's ``TorchConfig`` there) has set up the process group before it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from prodrl_pipelines.config import environment
from prodrl_pipelines.storage import documents, keys


def run_rank(rkey: str, rank: int, world: int, out_dir: Path | None = None,
             on_step_extra: Callable[[int, dict], None] | None = None, node: str | None = None) -> dict:
    """Train ``rkey`` as rank ``rank`` of ``world`` (the process group, when ``world > 1``, is already
    initialised); returns ``loop.train.train``'s stats. The rank records where it runs (rank, pid,
    node) in the store first, so a failure can be traced to a process."""
    import torch

    from prodrl_pipelines.loop.services import services_from_env
    from prodrl_pipelines.loop.train import train

    torch.set_num_threads(environment.threads_per_rank())
    svc = services_from_env()
    where = {"rank": rank, "world_size": world, "pid": os.getpid(), "node": node or socket.gethostname(),
             "host": socket.gethostname()}
    documents.put_json(svc.blobs, keys.train_worker(rkey, rank), where)
    # crash tests: the last rank SIGKILLs itself after this step, or says it holds there and waits to be killed
    kill_at, hold_at = environment.kill_rank_at_step(), environment.hold_rank_at_step()

    def on_step(step: int, m: dict) -> None:
        if on_step_extra is not None:
            on_step_extra(step, m)
        if rank == world - 1 and step in {kill_at, hold_at} - {0}:
            if step == hold_at:
                documents.put_json(svc.blobs, keys.train_worker(rkey, rank), {**where, "holding_at_step": step})
                time.sleep(600)  # nobody came: the step goes on (the test fails on its own timeout)
            else:
                os.kill(os.getpid(), signal.SIGKILL)

    return train(svc, rkey, on_step=on_step, progress=False, rank=rank, world_size=world, out_dir=out_dir)


def report_metadata(stats: dict, world: int) -> dict:
    """The round's figures as plain materialisation metadata (the per-step metrics as ``steps_json``),
    the same for every launcher."""
    return {**{k: v for k, v in stats.items() if isinstance(v, (int, float, str))}, "train_processes": world,
            "steps_json": json.dumps(stats["steps"])}


def step_logger(log: Callable[[str], None]) -> Callable[[int, dict], None]:
    """An ``on_step`` that writes one line per step (rank 0's progress in the Dagster logs)."""
    return lambda step, m: log(f"step {step}: " + json.dumps({k: round(v, 5) for k, v in m.items()}))


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--round", required=True)
    ap.add_argument("--out", help="checkpoint directory (default: the round's checkpoint)")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    pipes_ctx = contextlib.nullcontext(None)
    if rank == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes

        pipes_ctx = open_dagster_pipes()
    with pipes_ctx as pipes:
        stats = run_rank(args.round, rank, world, Path(args.out) if args.out else None,
                         step_logger(pipes.log.info) if pipes is not None else None)
        if pipes is None and rank == 0:  # standalone: the round's figures on stdout, one JSON line
            print(json.dumps({k: v for k, v in stats.items() if isinstance(v, (int, float, str))}), flush=True)
        if pipes is not None:
            md = report_metadata(stats, world)
            md["steps_json"] = {"raw_value": md["steps_json"], "type": "json"}
            pipes.report_asset_materialization(metadata=md)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
