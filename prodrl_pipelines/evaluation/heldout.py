"""Held-out reward of one exported policy on the suite, served the way the deployment serves it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prodrl_pipelines.evaluation.episodes import play_episodes, stop_token_ids
from prodrl_pipelines.evaluation.statistics import mean_confidence_interval


def evaluate_policy(settings, suite, export_dir: str | Path, policy_version: str, engine=None) -> dict:
    """Per-task rewards, mean and 95% half-width of ``policy_version`` on ``suite``'s first
    ``eval.heldout_size`` held-out tasks (seed ``eval.eval_seed``); ``engine`` defaults to the local
    engine on the export (NVFP4 dequantized, as deployed). Reward-function errors are counted."""
    from prodrl_pipelines.engines.local import LocalEngine

    engine = engine or LocalEngine.from_pretrained(export_dir)
    tok = engine.tokenizer
    tasks = suite.heldout_tasks(settings.eval.heldout_size)
    if not tasks:
        raise ValueError(f"suite {suite.name!r} has no held-out tasks")
    params = settings.deploy.sampling()
    eps = play_episodes(engine, tok, suite, tasks, params, policy_version, settings.eval.eval_seed,
                        stops=stop_token_ids(tok, export_dir))
    rewards = [e.reward for e in eps]
    errors = [e.reward_error for e in eps if e.reward_error]
    mean, ci = mean_confidence_interval(np.asarray(rewards))
    return {"policy_version": policy_version, "task_ids": [e.task_id for e in eps], "rewards": rewards,
            "mean": mean, "ci95": ci, "num_tasks": len(eps), "reward_errors": len(errors),
            "first_reward_error": errors[0] if errors else ""}
