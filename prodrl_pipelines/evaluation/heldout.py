"""Held-out reward of one exported policy on the suite, served the way the deployment serves it,
with the per-episode facts the behaviour monitors compare (``monitors.episode_facts``)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

from prodrl_pipelines.evaluation.monitors import episode_facts
from prodrl_pipelines.evaluation.statistics import mean_confidence_interval

log = logging.getLogger(__name__)


def heldout_tasks(settings, suite) -> list:
    """The suite's first ``heldout_size`` tasks. A suite holding fewer runs them all and says so,
    naming both numbers (the gate's confidence bound then tells whether that many can decide)."""
    tasks = suite.heldout_tasks(settings.eval.heldout_size)
    if not tasks:
        raise ValueError(f"suite {suite.name!r} has no held-out tasks")
    if len(tasks) < settings.eval.heldout_size:
        log.warning(heldout_shortfall(settings.eval.heldout_size, len(tasks), suite.name))
    return tasks


def heldout_shortfall(asked: int, have: int, suite_name: str) -> str:
    return (f"heldout_size={asked} but suite {suite_name!r} holds only {have} held-out tasks: evaluating "
            f"{have}; the gate's paired bound over {have} tasks may be too wide to decide")


def evaluate_policy(settings, suite, export_dir: str | Path, policy_version: str, engine=None,
                    keep_calls: bool = False, runner=None) -> dict:
    """Per-task rewards, mean and 95% half-width of ``policy_version`` on ``suite``'s first
    ``eval.heldout_size`` held-out tasks (seed ``eval.eval_seed``); ``engine`` defaults to the local
    engine on the export (NVFP4 dequantized, as deployed). Reward-function errors are counted.
    ``facts``: per episode, what the monitors compare. ``keep_calls``: also return every call's
    prompt ids, output ids and logprobs (``calls``; for the KL monitor, not for storing).

    The episodes are played in batches of ``eval.episode_batch`` by ``runner`` (``runners``; default:
    this process; ``engine`` given: this process on it): the same episodes wherever they run."""
    from prodrl_pipelines.evaluation.runners import EpisodeWork, InProcessRunner
    from prodrl_pipelines.evaluation.served import evaluate_served
    from prodrl_pipelines.evaluation.suite import is_served

    if is_served(suite):  # its own harness plays the episodes over HTTP, in this process
        return evaluate_served(settings, suite, export_dir, policy_version, engine=engine, keep_calls=keep_calls)
    tasks = heldout_tasks(settings, suite)
    work = EpisodeWork(str(export_dir), policy_version, suite, tasks, settings.deploy.sampling(),
                       settings.eval.eval_seed, settings.eval.episode_batch)
    if engine is not None:
        eps = InProcessRunner().play(work, engine=engine)
    else:
        eps = (runner or InProcessRunner()).play(work)
    rewards = [e.reward for e in eps]
    errors = [e.reward_error for e in eps if e.reward_error]
    mean, ci = mean_confidence_interval(np.asarray(rewards))
    refusal = re.compile(settings.monitors.refusal_pattern)
    facts = [episode_facts(suite, t, e.assistant_texts, sum(len(c.record.output_token_ids) for c in e.calls), refusal)
             for t, e in zip(tasks, eps)]
    out = {"policy_version": policy_version, "task_ids": [e.task_id for e in eps], "rewards": rewards,
           "mean": mean, "ci95": ci, "num_tasks": len(eps), "heldout_size": settings.eval.heldout_size,
           "reward_errors": len(errors), "first_reward_error": errors[0] if errors else "", "facts": facts}
    if keep_calls:
        out["calls"] = [(c.prompt_token_ids, list(c.record.output_token_ids), list(c.record.output_logprobs))
                        for e in eps for c in e.calls]
    return out
