"""One round of training: S Adam steps on minibatches of B recorded trajectories.

The round-start policy pi_k is evaluated once over the whole dataset before the first step and
reused by every step (it is the IS/KL reference and the mismatch diagnostic's anchor).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from prodrl_pipelines.rl.advantages import compute_advantages
from prodrl_pipelines.rl.batch import PackedBatch
from prodrl_pipelines.rl.trajectory import Trajectory
from prodrl_pipelines.rl.microbatches import pack_micro, plan_microbatches
from prodrl_pipelines.rl.sequences import LayoutStats, Sequence, minibatch_sequences
from prodrl_pipelines.rl.checkpoint import TrainerState
from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rl.logprobs import policy_logprobs, uses_flash_attention
from prodrl_pipelines.rl.round_diagnostics import RoundDiagnostics
from prodrl_pipelines.rl.routing_replay import moe_shape
from prodrl_pipelines.rl.losses import SEQUENCE_LEVEL, TokenTerms, kl_penalty, policy_objective


@dataclass
class RoundResult:
    steps: list[dict[str, float]] = field(default_factory=list)
    skipped_steps: int = 0
    mismatch_abs_logp: float = float("nan")  # mean |log pi_k - log mu| over the round's tokens
    advantages: np.ndarray | None = None
    resumed_from_step: int = 0
    layout: LayoutStats | None = None  # merged / split calls, sequences and micro-batches of the round
    routing: dict[str, float] = field(default_factory=dict)  # MoE routing diagnostics (``round_diagnostics``)


def build_optimizer(model, recipe: Recipe, state: TrainerState,
                    load_state: Callable[[torch.optim.Optimizer, dict], None] | None = None) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (all of them; a LoRA policy's adapters only, so its state
    holds only theirs); restores the Adam moments carried from the previous round (``load_state``: how,
    for a sharded model; default ``Optimizer.load_state_dict``)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.learning_rate,
                            betas=recipe.adam_betas, weight_decay=recipe.weight_decay)
    if state.optimizer is not None:
        (load_state or torch.optim.Optimizer.load_state_dict)(opt, state.optimizer)
        for g in opt.param_groups:  # the recipe's current settings win over the saved ones
            g["lr"], g["betas"], g["weight_decay"] = recipe.learning_rate, recipe.adam_betas, recipe.weight_decay
    return opt


# 1 - Q_H floor of the support estimate: a head holding less than this of mu says little about S.
MIN_HEAD_MASS = 1e-6


def support_renormalised(lp_all: torch.Tensor, b: PackedBatch) -> torch.Tensor:
    """log pi_S(a) = log pi(a) - log sum_{v in S} pi(v) for tokens served with top-k/top-p.

    S is the recorded head when it holds the whole support (``support_complete``): sum_S pi is then
    exact. Otherwise H = the head plus the sampled token holds a part Q_H = sum_H mu of mu's mass
    (mu is normalised over S), and sum_S pi is estimated as sum_H pi / Q_H, exact when pi is
    proportional to mu on S (the head alone always underestimates it, so pi_S and the IS ratio came
    out too large even with deployment == trainer). Unfiltered tokens are returned unchanged (S =
    vocabulary).
    """
    K = b.head_mask.shape[1]
    head = lp_all[:, 1:1 + K].masked_fill(~b.head_mask, float("-inf"))
    lse = torch.logsumexp(head, dim=-1)
    lse = torch.where(b.target_in_head, lse, torch.logaddexp(lse, lp_all[:, 0]))
    q_head = torch.logsumexp(b.head_mu, dim=-1)
    q_head = torch.where(b.target_in_head, q_head, torch.logaddexp(q_head, b.logp_mu))
    log_q = q_head.clamp(min=math.log(MIN_HEAD_MASS), max=0.0)
    est = torch.where(b.support_complete, lse, (lse - log_q).clamp(max=0.0))  # sum_S pi <= 1
    return torch.where(b.filtered, lp_all[:, 0] - est, lp_all[:, 0])


def terms_for(lp_all: torch.Tensor, old_all: torch.Tensor, b: PackedBatch, logp_ref: torch.Tensor | None = None) -> TokenTerms:
    """All per-token quantities the corrections use, from [G, 1+K] log-probs (sampled + head)."""
    ref = None if logp_ref is None else support_renormalised(logp_ref, b)
    K = b.head_mask.shape[1]
    return TokenTerms(
        logp=lp_all[:, 0], logp_old=old_all[:, 0], logp_mu=b.logp_mu, adv=b.adv,
        logp_is=support_renormalised(lp_all, b), logp_old_is=support_renormalised(old_all, b),
        head_logp=lp_all[:, 1:1 + K], head_mu=b.head_mu, head_mask=b.head_mask, support_complete=b.support_complete,
        logp_ref=ref, logp_extra=lp_all[:, 1 + K] if bool(b.has_extra.all()) else None,
        seq=b.traj_index, trained=b.weight > 0,
    )


def head_entropy(lp_all: torch.Tensor, b: PackedBatch) -> float:
    """Mean entropy of pi restricted to the recorded head (renormalised)."""
    K = b.head_mask.shape[1]
    head = lp_all[:, 1:1 + K].detach().masked_fill(~b.head_mask, float("-inf"))
    logq = head - torch.logsumexp(head, -1, keepdim=True)
    return float(-(logq.exp() * logq.masked_fill(~b.head_mask, 0)).sum(-1).mean())


def _plan_fingerprint(plan: list[list[int]], adv: np.ndarray, recipe: Recipe) -> str:
    import hashlib

    layout = [recipe.max_tokens_per_microbatch, recipe.merge_turns]
    return hashlib.sha256(json.dumps([plan, np.round(adv, 12).tolist(), layout]).encode()).hexdigest()[:16]


def _save_in_round(path: Path, fingerprint: str, next_step: int, model, optimizer, state: TrainerState,
                   result: RoundResult) -> None:
    """Atomically persist everything needed to continue at ``next_step`` (weights, Adam, RNG); a
    sharded model as a ``torch.distributed.checkpoint`` directory, each rank writing its part."""
    meta = {
        "fingerprint": fingerprint, "next_step": next_step, "global_step": state.global_step,
        "baseline": dict(vars(state.baseline)), "rng": torch.get_rng_state(), "steps": result.steps,
        "skipped": result.skipped_steps,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    if _sharded(model):
        from prodrl_pipelines.rl.sharding import save_sharded_state

        save_sharded_state(path, model, optimizer, meta)
        return
    payload = {**meta, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _resume(path: Path, fingerprint: str, model, optimizer, state: TrainerState, result: RoundResult) -> int:
    if _sharded(model):  # a collective: every rank takes part, with or without a state of its own
        from prodrl_pipelines.rl.sharding import load_sharded_state

        raw = load_sharded_state(path, model, optimizer, fingerprint)
        if raw is None:  # none, or a different dataset/plan: start the round afresh
            return 0
    elif not path.exists():
        return 0
    else:
        raw = torch.load(path, map_location="cpu", weights_only=False)
        if raw["fingerprint"] != fingerprint:  # a different dataset/plan: start the round afresh
            return 0
        model.load_state_dict(raw["model"])
        optimizer.load_state_dict(raw["optimizer"])
    state.global_step = raw["global_step"]
    for k, v in raw["baseline"].items():
        setattr(state.baseline, k, v)
    torch.set_rng_state(raw["rng"])
    result.steps = list(raw["steps"])
    result.skipped_steps = raw["skipped"]
    result.resumed_from_step = raw["next_step"]
    return int(raw["next_step"])


# per-step diagnostics that are maxima over tokens (the others are token-weighted means)
_MAX_DIAGNOSTICS = ("is_weight_max",)


def _merge_diagnostics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """One step's diagnostics from its micro-batches' (tokens, diagnostics)."""
    total = sum(n for n, _ in parts) or 1
    out: dict[str, float] = {}
    for key in parts[0][1] if parts else ():
        vals = [(n, d[key]) for n, d in parts if key in d]
        out[key] = max(v for _, v in vals) if key in _MAX_DIAGNOSTICS else sum(n * v for n, v in vals) / total
    return out


def train_step(model, optimizer, micro: Iterable[PackedBatch], old_all: list[torch.Tensor],
               ref_all: list[torch.Tensor] | None, recipe: Recipe, cparams, replay: bool = False) -> dict[str, float]:
    """One Adam step on one minibatch, its gradient accumulated over ``micro`` (this process's
    micro-batches; ``old_all``/``ref_all``: their pi_k / pi_ref log-probs): loss = -J + beta * KL,
    a sum over tokens, so the micro-batches' losses add up to the minibatch's. Returns the step's
    diagnostics. ``replay``: the forwards use the micro-batches' recorded MoE routing."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, kl_sum, tokens, inputs, parts, n_micro = 0.0, 0.0, 0, 0, [], 0
    for m, b in enumerate(micro):
        n_micro = m + 1
        lp_all = policy_logprobs(model, b, recipe.logprob_chunk, replay=replay)
        terms = terms_for(lp_all, old_all[m], b, None if ref_all is None else ref_all[m])
        objective, diag = policy_objective(terms, b.weight, recipe.correction, cparams)
        kl = kl_penalty(terms, b.weight)
        loss = -objective + recipe.kl_beta * kl if recipe.kl_beta > 0 else -objective
        loss.backward()  # accumulates; sharded (FSDP2): the gradients are reduce-scattered as a sum here
        if b.filler:
            continue
        with torch.no_grad():
            # mismatch against mu uses pi renormalised over the served support (mu is processed)
            lp, old = terms.logp_is.detach(), terms.logp_old_is
            diag = {**diag,
                    "engine_mismatch": float((old - b.logp_mu).abs().mean()),  # |log pi_k - log mu|
                    "staleness": float((lp - old).abs().mean()),  # |log pi - log pi_k|
                    "net_mismatch": float((lp - b.logp_mu).abs().mean()),  # |log pi - log mu|
                    "head_entropy": head_entropy(lp_all, b)}
        parts.append((b.num_tokens, diag))
        loss_sum += float(loss.detach())
        kl_sum += float(kl.detach())
        tokens += b.num_tokens
        inputs += b.num_inputs
        del lp_all, terms, loss
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # sharded: a DTensor
    optimizer.step()
    dt = time.perf_counter() - t0
    return {
        "loss": loss_sum,
        "grad_norm": grad_norm,
        "kl": kl_sum,
        "tokens": float(tokens),
        "input_tokens": float(inputs),
        "micro_batches": float(n_micro),
        "tokens_per_s": tokens / dt,
        "skipped": 0.0,
        **_merge_diagnostics(parts),
    }


def _reference_logprobs(reference, b: PackedBatch, versions: list[str], chunk: int, replay: bool = False) -> torch.Tensor:
    """policy_logprobs under the reference; with ``{version: model}``, each token's row comes from
    the model of its trajectory's policy version (``versions[j]`` for trajectory j of the shard)."""
    if not isinstance(reference, Mapping):
        return policy_logprobs(reference, b, chunk, replay=replay)
    missing = sorted(set(versions) - set(reference))
    if missing:
        raise ValueError(f"no reference model for policy versions {missing} (have {sorted(reference)})")
    names = sorted(set(versions))
    tok_version = torch.tensor([names.index(v) for v in versions], dtype=torch.long, device=b.traj_index.device)[b.traj_index]
    out = None
    for i, v in enumerate(names):
        lp = policy_logprobs(reference[v], b, chunk, replay=replay)
        out = lp if out is None else torch.where((tok_version == i)[:, None], lp, out)
    return out


def plan_minibatches(trajs: list[Trajectory], recipe: Recipe, round_seed: int) -> list[list[int]]:
    """Deterministic shuffle of the S*B trajectories into S minibatches of B (each used once)."""
    n_req = recipe.trajectories_per_round
    if len(trajs) < n_req:
        raise ValueError(
            f"round needs S*B = {n_req} trajectories (steps_per_round={recipe.steps_per_round} x "
            f"batch_size={recipe.batch_size}) but the dataset has {len(trajs)}"
        )
    perm = np.random.default_rng(round_seed).permutation(len(trajs))[:n_req]
    return [perm[s * recipe.batch_size:(s + 1) * recipe.batch_size].tolist() for s in range(recipe.steps_per_round)]


def round_advantages(trajs: list[Trajectory], recipe: Recipe, state: TrainerState) -> np.ndarray:
    """A_i for the round's dataset with the recipe's baseline (updates an `ema` baseline's state)."""
    return compute_advantages(
        [t.reward for t in trajs], recipe.baseline, task_ids=[t.task_id for t in trajs],
        state=state.baseline, normalize_std=recipe.normalize_adv_std, ema_decay=recipe.ema_decay,
    )


def layout_round(trajs: list[Trajectory], adv_all: np.ndarray, plan: list[list[int]], recipe: Recipe,
                 rank: int = 0, world_size: int = 1) -> tuple[list[tuple[list[Sequence], list[list[int]]]], LayoutStats]:
    """Each minibatch's sequences (calls merged where their prompts extend) and this rank's
    micro-batches of them (index lists; [] = a filler), plus what merging and splitting did. Every
    rank computes the whole layout (cheap, deterministic) and keeps its own micro-batches."""
    stats = LayoutStats()
    out = []
    whole = recipe.correction in SEQUENCE_LEVEL  # a trajectory's sequences share one micro-batch
    for mb in plan:
        seqs = minibatch_sequences([trajs[i] for i in mb], adv_all[mb], len(mb), recipe.merge_turns, stats)
        groups = [q.spans[0].traj for q in seqs] if whole else None
        micro = plan_microbatches([q.num_inputs for q in seqs], recipe.max_tokens_per_microbatch, world_size, groups)
        stats.micro_batches += micro.num_micro
        stats.oversize_sequences += micro.oversize
        out.append((seqs, micro.ranks[rank]))
    return out, stats


def train_round(
    model,
    optimizer: torch.optim.Optimizer,
    trajs: list[Trajectory],
    adv_all: np.ndarray,
    plan: list[list[int]],
    recipe: Recipe,
    state: TrainerState,
    pad_id: int,
    round_seed: int,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    progress: bool = True,
    reference_model=None,
    resume_path: Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    behavior_steps: Mapping[str, int] | None = None,
    on_saved: Callable[[Path], None] | None = None,
) -> RoundResult:
    """S Adam steps, minibatch s = trajs[plan[s]], with precomputed advantages ``adv_all``.

    ``reference_model`` (``ref_is`` only): the deployed weights, dequantised, run by the trainer;
    either one model, or ``{policy_version: model}`` so each trajectory is referenced to the
    deployment that sampled it (one-round async mixes mu_{k-1} and mu_k data).
    ``behavior_steps``: ``{policy_version: global_step of the checkpoint it serves}``; each step
    then reports ``staleness_steps``, the mean number of optimizer steps between the weights being
    updated and the policy that sampled the minibatch (0..S-1 in sync, S..2S-1 in one-round async).
    ``resume_path``: in-round checkpoint file, written atomically every ``recipe.checkpoint_every``
    steps; when it exists (same plan), training resumes after its last step and ends with the same
    weights as an uninterrupted run. pi_k is always recomputed from the round-start weights.
    Each minibatch is laid out as sequences (a trajectory's calls merged where their prompts extend)
    packed without padding into micro-batches of at most ``recipe.max_tokens_per_microbatch``
    positions; the step accumulates their gradients (``layout_round``, ``train_step``).
    ``rank``/``world_size``: data parallel; this process trains its share of every minibatch's
    sequences (balanced by tokens) with the global B in the token weights, and ``model`` (sharded
    with ``rl.sharding.shard_policy``) sums the gradients over the ranks, so the step is one process's.
    """
    torch.manual_seed(round_seed)
    adv_all = np.asarray(adv_all, dtype=np.float64)
    if recipe.needs_reference_model and reference_model is None:
        raise ValueError(f"correction {recipe.correction!r} needs the deployed weights as a reference model")
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    one_row = uses_flash_attention(config)
    device = next(model.parameters()).device
    layout, stats = layout_round(trajs, adv_all, plan, recipe, rank, world_size)

    shape = moe_shape(getattr(model, "policy", model))
    moe = shape is not None
    with_routing = moe and any(c.routing is not None for i in {i for mb in plan for i in mb} for c in trajs[i].calls)
    replay = recipe.routing_replay == "recorded" and with_routing
    if recipe.routing_replay == "recorded" and not moe:
        warnings.warn("routing_replay='recorded' is ignored: the policy has no MoE router", stacklevel=2)

    def micro_batches(s: int):  # packed when used, on the model's device: peak memory follows the budget
        seqs, micro = layout[s]
        return (pack_micro(seqs, idx, pad_id, vocab, one_row, with_routing).to(device) for idx in micro)

    chunk = recipe.logprob_chunk
    cparams = recipe.correction_params()
    # pi_k (and pi_ref) once per round from the round-start weights, kept per token, reused by all S steps.
    model.eval()
    old_all: list[list[torch.Tensor]] = []
    ref_all: list[list[torch.Tensor]] | None = None if reference_model is None else []
    diag = RoundDiagnostics(replay, shape[0] if moe else 0, world_size, device)  # the same figures on every rank
    with torch.no_grad():
        for s in tqdm(range(len(plan)), desc="pi_k", disable=not progress, leave=False):
            versions = [trajs[i].policy_version for i in plan[s]]
            olds, refs = [], []
            for b in micro_batches(s):
                olds.append(policy_logprobs(model, b, chunk, replay=replay, routing_stats=diag.stats))
                if ref_all is not None:
                    refs.append(_reference_logprobs(reference_model, b, versions, chunk, replay))
                # every rank or none runs the extra forward (FSDP2 gathers parameters in each one)
                alt = policy_logprobs(model, b, chunk, replay=not replay) if with_routing and diag.due(b) else None
                diag.add(b, (support_renormalised(olds[-1], b) - b.logp_mu).abs(),
                         None if alt is None else (support_renormalised(alt, b) - b.logp_mu).abs())
            old_all.append(olds)
            if ref_all is not None:
                ref_all.append(refs)
    result = RoundResult(mismatch_abs_logp=diag.mismatch_abs_logp(), advantages=adv_all, layout=stats,
                         routing=diag.routing())
    fingerprint = _plan_fingerprint(plan, adv_all, recipe)
    start = _resume(resume_path, fingerprint, model, optimizer, state, result) if resume_path else 0

    model.train()
    for s in tqdm(range(len(plan)), desc="train", disable=not progress, leave=False):
        if s < start:
            continue
        if resume_path is not None and recipe.checkpoint_every and s > start and s % recipe.checkpoint_every == 0:
            _save_in_round(resume_path, fingerprint, s, model, optimizer, state, result)
            if on_saved is not None:  # e.g. mirrored to the store, for a resume on another machine
                on_saved(resume_path)
        adv_mb = adv_all[plan[s]]
        base = {
            "adv_mean": float(adv_mb.mean()), "adv_std": float(adv_mb.std()),
            "reward_mean": float(np.mean([trajs[i].reward for i in plan[s]])),
        }
        if behavior_steps is not None:
            base["staleness_steps"] = float(np.mean([state.global_step - behavior_steps[trajs[i].policy_version]
                                                     for i in plan[s]]))
        if np.all(adv_mb == 0):
            # No learning signal: skip (and count) rather than take an empty Adam step.
            result.skipped_steps += 1
            result.steps.append({**base, "skipped": 1.0})
            if on_step is not None:
                on_step(state.global_step, result.steps[-1])
            continue
        metrics = {**base, **train_step(model, optimizer, micro_batches(s), old_all[s],
                                        None if ref_all is None else ref_all[s], recipe, cparams, replay)}
        state.global_step += 1
        result.steps.append(metrics)
        if on_step is not None:
            on_step(state.global_step, metrics)
    state.rounds_trained += 1
    return result
