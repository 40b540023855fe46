"""Training worker launched by `torchrun` (through Dagster Pipes) for one round.

    torchrun --nproc_per_node N -m prodrl_pipelines.ops.train_worker --round round-000007

The policy is sharded with FSDP2 (``rl.sharding``: each decoder layer and the root; parameters,
gradients and Adam state split over the ranks; gloo on CPU, nccl on GPUs). Each rank trains its
shard of every minibatch, the gradients are reduce-scattered as a sum, so every rank takes its
part of the same Adam step; the round's checkpoint is gathered whole and written by rank 0. Settings come from the environment exactly as for the code location
(PRODRL_SETTINGS_JSON, PRODRL_STORE_ROOT). Rank 0 reports metrics and the checkpoint path back
to Dagster through Pipes when launched by a Pipes client, and runs standalone otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from prodrl_pipelines.config import environment
from prodrl_pipelines.loop.services import services_from_env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--round", required=True)
    ap.add_argument("--out", help="checkpoint directory (default: the round's checkpoint)")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.set_num_threads(environment.threads_per_rank())
    pipes_ctx = contextlib.nullcontext(None)
    if rank == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes

        pipes_ctx = open_dagster_pipes()
    from prodrl_pipelines.loop.train import train

    # crash tests: the last rank kills itself (SIGKILL) after this global step
    kill_at = environment.kill_rank_at_step()
    with pipes_ctx as pipes:
        def on_step(step: int, m: dict) -> None:
            if pipes is not None:
                pipes.log.info(f"step {step}: " + json.dumps({k: round(v, 5) for k, v in m.items()}))
            if kill_at and step == kill_at and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)

        stats = train(services_from_env(), args.round, on_step=on_step, progress=False, rank=rank,
                      world_size=world,
                      out_dir=Path(args.out) if args.out else None)
        if pipes is None and rank == 0:  # standalone: the round's figures on stdout, one JSON line
            print(json.dumps({k: v for k, v in stats.items() if isinstance(v, (int, float, str))}), flush=True)
        if pipes is not None:
            steps = stats.pop("steps")
            pipes.report_asset_materialization(metadata={
                **{k: v for k, v in stats.items() if isinstance(v, (int, float, str))}, "train_processes": world,
                "steps_json": {"raw_value": json.dumps(steps), "type": "json"},
            })
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
