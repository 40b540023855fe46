"""Step 3 of a round: S optimizer steps from the live checkpoint (in-process, or one rank of
torchrun with FSDP2)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import numpy as np

from prodrl_pipelines.loop import in_round
from prodrl_pipelines.loop.services import (
    Services, check_recipe_fits_deployment, publish_checkpoint, reference_export, refuse_if_decided, round_seed, upstream_json,
    upstream_table, version_dirs,
)
from prodrl_pipelines.storage import documents, keys


def train(svc: Services, rkey: str, on_step: Callable[[int, dict], None] | None = None, progress: bool = True,
          rank: int = 0, world_size: int = 1, out_dir: Path | None = None) -> dict:
    """S Adam steps from the live checkpoint. With ``world_size > 1`` (``torchrun``) the policy is
    sharded with FSDP2, every rank trains its shard of each minibatch and only rank 0 writes the
    outputs."""
    import torch

    from prodrl_pipelines.rl.advantages import BaselineState
    from prodrl_pipelines.rl.trajectory import trajectories_from_table
    from prodrl_pipelines.rl.checkpoint import load_policy, load_trainer_state, save_checkpoint
    from prodrl_pipelines.rl.trainer import build_optimizer, train_round

    if out_dir is None:  # a worker's scratch copy is not the round's history
        refuse_if_decided(svc, rkey, "trained_checkpoint")
    s, live = svc.settings, svc.live()
    batch = upstream_json(svc, keys.batch(rkey))
    trajs = {t.trajectory_id: t for t in trajectories_from_table(upstream_table(svc, keys.dataset(rkey)))}
    trajs = [trajs[i] for i in batch["trajectory_ids"]]
    model, tokenizer = load_policy(Path(live.checkpoint_dir), dtype=torch.float32)
    state = load_trainer_state(Path(live.checkpoint_dir))
    state.baseline = BaselineState(**batch["baseline_state"])
    model, base_version = _lora_policy(svc, live, model, state, world_size)
    if s.recipe.activation_checkpointing:
        from prodrl_pipelines.rl.sharding import checkpoint_activations

        checkpoint_activations(model)
    trained, load_opt, sharded = model, None, world_size > 1
    # a sharded LoRA policy is saved from a whole copy (PEFT saves and merges a plain model): rank 0
    # keeps one, and loads the gathered state into it at the end
    whole_policy = copy.deepcopy(model) if sharded and base_version is not None and rank == 0 else None
    if sharded:  # FSDP2: parameters, gradients and Adam state sharded over the ranks
        from prodrl_pipelines.rl import sharding

        trained = sharding.shard_policy(model, world_size)
        load_opt = lambda o, sd: sharding.load_full_optimizer_state(trained, o, sd)  # noqa: E731
    opt = build_optimizer(trained, s.recipe, state, load_opt)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # The policies that sampled this round's data: mu_k (sync), or mu_{k-1} and mu_k (one-round async).
    data_versions = sorted({t.policy_version for t in trajs})
    behavior_steps = {v: load_trainer_state(version_dirs(svc, v)[0]).global_step for v in data_versions}
    reference = None
    if s.recipe.needs_reference_model:
        check_recipe_fits_deployment(svc, live)
        reference = {}
        for v in data_versions:  # each trajectory's own deployed weights, upcast
            export_dir = reference_export(svc, v, version_dirs(svc, v)[1], f"it sampled data of {rkey}")
            reference[v] = served_weights(export_dir)
            reference[v].eval()
    # in-round resume: one file (one process), or a directory per rank for its part of a sharded save
    # (ranks on machines that share no disk); kept in the blob store after every save, so that any
    # machine resumes the round (``in_round``)
    state_name = f"{rkey}-fsdp{world_size}" if sharded else f"{rkey}-rank{rank}.pt"
    resume = s.checkpoints_root / ".in-round" / (f"{state_name}/rank{rank}" if sharded else state_name)
    if sharded:  # every rank resumes from the store's complete state, or none does
        in_round.pull(svc.blobs, resume, state_name, whole=True)
        torch.distributed.barrier()
    else:
        in_round.pull(svc.blobs, resume, state_name)
    exporter = None
    if rank == 0 and s.observability.trainer_metrics_port:  # Prometheus gauges while the round trains
        from prodrl_pipelines.observability.trainer_metrics import TrainerMetrics

        exporter = TrainerMetrics(rkey).start(s.observability.trainer_metrics_host, s.observability.trainer_metrics_port)
        on_step = _both(exporter.on_step, on_step)
    try:
        res = train_round(trained, opt, trajs, np.asarray(batch["advantages"]), batch["plan"], s.recipe, state,
                          pad_id, round_seed(s, rkey), on_step=on_step, progress=progress, reference_model=reference,
                          resume_path=resume, rank=rank, world_size=world_size,
                          behavior_steps=behavior_steps,
                          on_saved=_mirror_sharded(svc, state_name, rank) if sharded else
                          (lambda p: in_round.push(svc.blobs, p, state_name)))
    finally:
        if exporter is not None:
            exporter.close(s.observability.trainer_metrics_final_scrape_s)
    out = Path(out_dir) if out_dir is not None else s.checkpoints_root / rkey
    whole = {}
    if sharded:  # gathered by every rank (collectives), written whole by rank 0
        whole = {"model_state": sharding.full_model_state(trained),
                 "optimizer_state": sharding.full_optimizer_state(trained, opt)}
    if rank == 0:
        if base_version is not None:  # the merged weights, read like a full round's, and the adapter
            from prodrl_pipelines.rl import lora

            policy = model
            if whole_policy is not None:
                whole_policy.load_state_dict(whole["model_state"])
                policy = whole_policy
            save_checkpoint(out, lora.merged_copy(policy), tokenizer, opt, state,
                            optimizer_state=whole.get("optimizer_state"), extra=lora.write_lora_parts(policy, base_version))
        else:
            save_checkpoint(out, model, tokenizer, opt, state, **whole)
        if out_dir is None:  # the round's own checkpoint (not a worker's scratch copy)
            publish_checkpoint(svc, rkey, out)
        documents.put_json(svc.blobs, keys.train_steps(rkey), res.steps)
        svc.ledger.update_round(rkey, mismatch_abs_logp=res.mismatch_abs_logp, trained_from=live.policy_version,
                                  train_processes=world_size)
    if sharded:  # the round's checkpoint is complete
        sharding.remove_sharded_state(resume)
    else:
        resume.unlink(missing_ok=True)
    if rank == 0:
        in_round.drop(svc.blobs, state_name)
    done = [m for m in res.steps if not m.get("skipped")]
    return {
        "checkpoint_dir": str(out), "trained_from": live.policy_version, "global_step": state.global_step,
        "resumed_from_step": res.resumed_from_step,
        "steps_taken": len(done), "steps_skipped": res.skipped_steps,
        "mismatch_abs_logp": res.mismatch_abs_logp,
        **res.layout.as_metrics(),
        **res.routing,
        "final_loss": done[-1]["loss"] if done else float("nan"),
        "mean_grad_norm": float(np.mean([m["grad_norm"] for m in done])) if done else float("nan"),
        "tokens_per_s": float(np.mean([m["tokens_per_s"] for m in done])) if done else float("nan"),
        "steps": res.steps,
    }


def _lora_policy(svc: Services, live, model, state, world_size: int):
    """The policy this round trains, and the version whose frozen weights a LoRA round adapts (None:
    full training). ``training: lora`` trains the live round's adapter on its frozen base (the first
    LoRA round: a fresh adapter on the live weights); Adam's state carries over only between rounds of
    the same kind (a full round's does not fit the adapters, nor theirs the full model)."""
    from prodrl_pipelines.rl import lora
    from prodrl_pipelines.rl.checkpoint import load_policy

    adapter, base_version = lora.adapter_of(live.checkpoint_dir)
    if svc.settings.recipe.training != "lora":
        if adapter is not None:
            state.optimizer = None
        return model, None
    if adapter is None:
        state.optimizer = None
        return lora.with_adapter(model, svc.settings.recipe), live.policy_version
    base, _ = load_policy(version_dirs(svc, base_version)[0])
    return lora.with_adapter(base, svc.settings.recipe, adapter), base_version


def _both(first, second):
    """A step callback calling ``first`` then ``second`` (when given)."""
    def on_step(step: int, metrics: dict) -> None:
        first(step, metrics)
        if second is not None:
            second(step, metrics)

    return on_step


def _mirror_sharded(svc: Services, name: str, rank: int):
    """After a sharded save: every rank uploads its part under one upload, then rank 0 publishes it."""
    import torch.distributed as dist

    def mirror(path: Path) -> None:
        upload = [in_round.new_upload()]
        dist.broadcast_object_list(upload, src=0)
        mine = in_round.upload_part(svc.blobs, path, name, upload[0])
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        if rank == 0:
            in_round.publish(svc.blobs, name, upload[0], sorted({f for p in parts for f in p}), is_dir=True)
        dist.barrier()

    return mirror


def training_history(svc: Services) -> tuple[list[dict], list[int]]:
    """Every trained step of every round so far, in order, and the index where each round starts."""
    steps, starts = [], []
    for key in sorted(k.split("/")[1] for k in svc.blobs.list(keys.ROUNDS) if k.endswith("/train_steps.json")):
        starts.append(len(steps))
        steps += [m for m in upstream_json(svc, keys.train_steps(key)) if not m.get("skipped")]
    return steps, starts


def served_weights(export_dir: Path):
    """The weights that served a version, upcast (ref_is's reference): an adapter target served a LoRA
    round's adapter on its base export (``rl.lora.served_policy``); every other target, the export."""
    import torch

    from prodrl_pipelines.quant.adapter_export import adapter_export, served_as_adapter
    from prodrl_pipelines.rl.checkpoint import load_policy

    if served_as_adapter(export_dir):
        part = adapter_export(export_dir)
        from prodrl_pipelines.rl.lora import served_policy

        return served_policy(part[2], part[0], torch.float32)[0]
    return load_policy(export_dir, dtype=torch.float32)[0]
