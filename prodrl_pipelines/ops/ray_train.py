"""A round's training as a Ray job: Ray Train's ``TorchTrainer`` runs the same rank body as torchrun.

    python -m prodrl_pipelines.ops.ray_jobs train --round round-000007 [--out DIR]

The job's driver (on the cluster's head) starts ``cluster_workers`` Ray Train workers with the
resources of the cluster settings, placed by ``cluster_placement`` (``STRICT_SPREAD``: one rank per
node). Ray's ``TorchConfig`` sets up the process group (gloo on CPU, NCCL on GPUs), then every worker
runs ``train_worker.run_rank``: FSDP2, the in-round resume state, the checkpoint written whole by
rank 0. Rank 0's figures come back as the job's result, the metadata torchrun's rank 0 reports.
A worker that dies fails the job naming it (rank, node, pid, how it exited), in the job's log and in
the store (``keys.train_failure``) for the asset's error; Ray Train does not retry (re-materialising
resumes from the in-round checkpoint instead). Only workers whose placement group Ray removed from
under them (``removed_from_under``) let the round's retry policy resume at once.
"""

from __future__ import annotations

import argparse
import re
import uuid
from pathlib import Path

from prodrl_pipelines.config import environment
from prodrl_pipelines.ops.train_worker import report_metadata, run_rank, step_logger
from prodrl_pipelines.storage import documents, keys


class TrainingWorkerFailed(RuntimeError):
    """A Ray Train worker died or raised; the message names it."""


def _worker(config: dict) -> None:
    """One Ray Train worker: a rank of the round (the process group is Ray's)."""
    import ray
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    stats = run_rank(config["rkey"], rank, world, Path(config["out"]) if config["out"] else None,
                     step_logger(lambda line: print(line, flush=True)) if rank == 0 else None,
                     node=ray.get_runtime_context().get_node_id())
    if rank == 0:  # Ray Train keeps reported metrics only with a checkpoint: the store carries them
        from prodrl_pipelines.loop.services import services_from_env

        documents.put_json(services_from_env().blobs, keys.train_result(config["rkey"]), stats)


# Ray's words for how a worker process ended, in a dead actor's error
_EXIT = re.compile(r"Worker exit type: (\w+) Worker exit detail: (.+?\.)(?: |$)", re.S)


def _died(exc: BaseException) -> bool:
    """Whether the worker's process died (Ray saw its actor die), not just raised."""
    import ray.exceptions
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    return isinstance(exc, (ray.exceptions.RayActorError, WorkerHealthCheckFailedError))


def _worker_failures(error: BaseException) -> dict:
    """Rank -> the exception of each failed worker, from Ray Train's ``TrainingFailedError``."""
    return dict(getattr(error, "worker_failures", {}) or {})


def removed_from_under(error: BaseException) -> bool:
    """Whether every worker of the failed run died because Ray removed its placement group, not of
    the training: Ray Train's own placement-group cleaner does that when it judges the controller
    dead, and on a loaded cluster it has judged a live controller so (its state query came back
    empty) after training had finished. Such a round is retried, resuming from its checkpoint."""
    def removed(exc: BaseException) -> bool:
        m = _EXIT.search(str(exc)) if _died(exc) else None
        return m is not None and m[1] == "INTENDED_SYSTEM_EXIT" and "placement group was removed" in m[2]

    failures = _worker_failures(error)
    return bool(failures) and all(removed(exc) for exc in failures.values())


def describe_failure(svc, rkey: str, error: BaseException) -> str:
    """``error`` (Ray Train's ``TrainingFailedError``) as one sentence per failed worker, those whose
    process died first (the others usually only lost their peer in a collective)."""
    failures = _worker_failures(error)
    if not failures:
        return f"training of {rkey} on Ray failed: {error}"
    lines = []
    for rank, exc in sorted(failures.items(), key=lambda kv: (not _died(kv[1]), kv[0])):
        key = keys.train_worker(rkey, rank)
        rec = documents.get_json(svc.blobs, key) if svc.blobs.exists(key) else {}
        where = f"rank {rank} (node {rec.get('node', '?')}, pid {rec.get('pid', '?')})"
        text = str(exc).strip()
        if _died(exc):
            m = _EXIT.search(text)
            lines.append(f"training worker {where} died: " + (f"exit {m[1]}: {m[2]}" if m else text.splitlines()[0]))
        else:
            last = (text.splitlines() or [type(exc).__name__])[-1]
            lines.append(f"training worker {where} failed: {type(exc).__name__}: {last[:300]}")
    return f"training of {rkey} on Ray failed: " + "; ".join(lines)


def train_job(argv: list[str]) -> dict:
    """Train the round on the job's Ray cluster; returns ``{"metadata": ...}`` (rank 0's figures)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    from prodrl_pipelines.cluster.config import cluster_settings
    from prodrl_pipelines.loop.services import services_from_env

    ap = argparse.ArgumentParser(prog="ray_jobs train")
    ap.add_argument("--round", required=True)
    ap.add_argument("--out", help="checkpoint directory (default: the round's checkpoint)")
    args = ap.parse_args(argv)
    flat = environment.read_settings()
    cluster, svc = cluster_settings(flat), services_from_env(flat)
    gpus = cluster.cluster_gpus_per_worker
    ray.init()  # the job's own cluster
    trainer = TorchTrainer(
        _worker, train_loop_config={"rkey": args.round, "out": args.out or ""},
        scaling_config=ScalingConfig(num_workers=cluster.cluster_workers, use_gpu=gpus > 0,
                                     resources_per_worker={"CPU": cluster.cluster_cpus_per_worker,
                                                           **({"GPU": gpus} if gpus > 0 else {})},
                                     placement_strategy=cluster.placement_strategy),
        torch_config=TorchConfig(backend="nccl" if gpus > 0 else "gloo"),
        # Ray's own run records; the round's checkpoints are the store's (rank 0 publishes them)
        run_config=RunConfig(name=f"{args.round}-{uuid.uuid4().hex[:8]}",
                             storage_path=str(svc.settings.checkpoints_root / ".ray-train"),
                             failure_config=FailureConfig(max_failures=0)))
    svc.blobs.delete(keys.train_result(args.round), missing_ok=True)
    try:
        trainer.fit()
    except TrainingFailedError as e:
        message = describe_failure(svc, args.round, e)
        documents.put_json(svc.blobs, keys.train_failure(args.round),  # for the asset
                           {"message": message, "retry": removed_from_under(e)})
        raise TrainingWorkerFailed(message) from None
    stats = documents.get_json(svc.blobs, keys.train_result(args.round))
    return {"metadata": report_metadata(stats, cluster.cluster_workers)}
