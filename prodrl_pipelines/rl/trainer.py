"""One round of training: S Adam steps on minibatches of B recorded trajectories.

The round-start policy pi_k is evaluated once over the whole dataset before the first step and
reused by every step (it is the IS/KL reference and the mismatch diagnostic's anchor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from prodrl_pipelines.rl.advantages import compute_advantages
from prodrl_pipelines.rl.batch import PackedBatch, Trajectory, pack_minibatch
from prodrl_pipelines.rl.checkpoint import TrainerState
from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rl.logprobs import token_logprobs
from prodrl_pipelines.rl.losses import TokenTerms, policy_objective


@dataclass
class RoundResult:
    steps: list[dict[str, float]] = field(default_factory=list)
    skipped_steps: int = 0
    mismatch_abs_logp: float = float("nan")  # mean |log pi_k - log mu| over the round's tokens
    advantages: np.ndarray | None = None


def build_optimizer(model, recipe: Recipe, state: TrainerState) -> torch.optim.Optimizer:
    """AdamW over all parameters; restores the Adam moments carried from the previous round."""
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=recipe.adam_betas,
                            weight_decay=recipe.weight_decay)
    if state.optimizer is not None:
        opt.load_state_dict(state.optimizer)
        for g in opt.param_groups:  # the recipe's current settings win over the saved ones
            g["lr"], g["betas"], g["weight_decay"] = recipe.learning_rate, recipe.adam_betas, recipe.weight_decay
    return opt


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
) -> RoundResult:
    """S Adam steps, minibatch s = trajs[plan[s]], with precomputed advantages ``adv_all``."""
    torch.manual_seed(round_seed)
    adv_all = np.asarray(adv_all, dtype=np.float64)
    batches: list[PackedBatch] = [pack_minibatch([trajs[i] for i in mb], adv_all[mb], pad_id) for mb in plan]

    # pi_k once per round, reused by all S steps.
    model.eval()
    with torch.no_grad():
        logp_old = [token_logprobs(model, b) for b in batches]
    all_old = torch.cat(logp_old)
    all_mu = torch.cat([b.logp_mu for b in batches])
    result = RoundResult(mismatch_abs_logp=float((all_old - all_mu).abs().mean()), advantages=adv_all)

    model.train()
    for s, b in enumerate(tqdm(batches, desc="train", disable=not progress, leave=False)):
        t0 = time.perf_counter()
        adv_mb = adv_all[plan[s]]
        base = {
            "adv_mean": float(adv_mb.mean()), "adv_std": float(adv_mb.std()),
            "reward_mean": float(np.mean([trajs[i].reward for i in plan[s]])),
        }
        if np.all(adv_mb == 0):
            # No learning signal: skip (and count) rather than take an empty Adam step.
            result.skipped_steps += 1
            result.steps.append({**base, "skipped": 1.0})
            if on_step is not None:
                on_step(state.global_step, result.steps[-1])
            continue
        logp = token_logprobs(model, b)
        terms = TokenTerms(logp=logp, logp_old=logp_old[s], logp_mu=b.logp_mu, adv=b.adv)
        objective, diag = policy_objective(terms, b.weight, recipe.correction)
        loss = -objective
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip))
        optimizer.step()
        state.global_step += 1
        dt = time.perf_counter() - t0
        with torch.no_grad():
            lp = logp.detach()
            metrics = {
                **base,
                "loss": float(loss.detach()),
                "grad_norm": grad_norm,
                "engine_mismatch": float((logp_old[s] - b.logp_mu).abs().mean()),
                "staleness": float((lp - logp_old[s]).abs().mean()),
                "net_mismatch": float((lp - b.logp_mu).abs().mean()),
                "tokens": float(b.num_tokens),
                "tokens_per_s": b.num_tokens / dt,
                "skipped": 0.0,
                **diag,
            }
        result.steps.append(metrics)
        if on_step is not None:
            on_step(state.global_step, metrics)
    state.rounds_trained += 1
    return result
