"""Reward sources, chosen by name (``REWARD_SOURCES``).

- ``feedback``: rewards clients post to the recorder (``/v1/feedback``); it scores nothing itself.
  Its rows carry no version.
- ``grader``: ``package.module:function(trajectory) -> float | None`` on a ``view.TrajectoryView``;
  None means "cannot tell" (the trajectory stays pending). Version: the function's name and a hash
  of its module's source as loaded, so editing the grader makes a new version once a process imports
  the edit (a long-lived process keeps running, and naming, the code it imported: ``loaded_code_hash``).
- ``judge``: an LLM behind an OpenAI-compatible endpoint with a rubric (``judge.JudgeSource``).
- ``command``: any scorer as a command, trajectories in and rewards out as JSON lines
  (``command_source``); ``verifiers``: a verifiers taskset's rubric through it (``verifiers_suite``).
- ``inspect``: an inspect-ai task's scorers on each trajectory's sample (``inspect_suite``).

A source that fails on a trajectory (the grader raises, the judge times out or answers without a
score) leaves it unscored and reports the error; it never stands in a 0.
"""

from __future__ import annotations

from typing import Callable, Sequence

from prodrl_pipelines.rewards.code_version import loaded_code_hash
from prodrl_pipelines.rewards.command_source import CommandSource
from prodrl_pipelines.rewards.judge import JudgeSource
from prodrl_pipelines.rewards.outcome import Outcome, checked
from prodrl_pipelines.rewards.view import TrajectoryView


class FeedbackSource:
    name = "feedback"
    scores = False
    version = None  # client rows carry no version

    def __init__(self, settings) -> None:
        pass

    def score(self, views: Sequence[TrajectoryView], progress=None) -> list[Outcome]:
        raise TypeError("the feedback source scores nothing: clients post its rewards to /v1/feedback")


class GraderSource:
    name = "grader"
    scores = True

    def __init__(self, settings, fn: Callable | None = None) -> None:
        from prodrl_pipelines.evaluation.loading import import_object

        self.path = settings.grader
        self.fn = fn or import_object(self.path, "rewards_grader")
        if not callable(self.fn):
            raise ValueError(f"rewards_grader={self.path!r} is not callable")
        self.version = f"{self.path}@{loaded_code_hash(self.fn)}"

    def score(self, views: Sequence[TrajectoryView], progress=None) -> list[Outcome]:
        out = []
        for v in views:
            try:
                out.append(checked(self.fn(v), f"grader {self.path}"))
            except Exception as e:  # noqa: BLE001 - a grader bug leaves the trajectory pending, counted
                out.append(Outcome(None, f"{type(e).__name__}: {e}"))
            if progress is not None:
                progress(1)
        return out


def _inspect_source(settings):
    from prodrl_pipelines.evaluation.inspect_suite import InspectRewardSource

    return InspectRewardSource(settings)


def _verifiers_source(settings):
    from prodrl_pipelines.evaluation.verifiers_suite import verifiers_reward_source

    return verifiers_reward_source(settings)


_inspect_source.scores = _verifiers_source.scores = True

# name -> factory(settings); ``scores``: the source scores stored traffic itself
REWARD_SOURCES: dict = {"feedback": FeedbackSource, "grader": GraderSource, "judge": JudgeSource,
                        "command": CommandSource, "inspect": _inspect_source, "verifiers": _verifiers_source}


def make_source(name: str, settings):
    """The configured source ``name`` (``settings``: ``RewardSettings``)."""
    if name not in REWARD_SOURCES:
        raise ValueError(f"unknown reward source {name!r}; known: {', '.join(sorted(REWARD_SOURCES))}")
    return REWARD_SOURCES[name](settings)
