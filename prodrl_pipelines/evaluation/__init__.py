"""Held-out evaluation: a suite of tasks (the plug point), the episode loop, the held-out reward."""

from prodrl_pipelines.evaluation.episodes import PlayedEpisode, play_episodes, stop_token_ids
from prodrl_pipelines.evaluation.heldout import evaluate_policy
from prodrl_pipelines.evaluation.loading import load_suite
from prodrl_pipelines.evaluation.suite import SuiteError
from prodrl_pipelines.evaluation.suite import EvalSuite

__all__ = ["EvalSuite", "SuiteError", "load_suite", "play_episodes", "PlayedEpisode", "stop_token_ids",
           "evaluate_policy"]
