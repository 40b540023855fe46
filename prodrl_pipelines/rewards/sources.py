"""Reward sources, chosen by name (``reward_sources()``): the three built here, and those registered
as entry points of group ``prodrl_pipelines.reward_sources`` (the harnesses this project ships,
``prodrl_pipelines.harnesses``, and plug-ins).

- ``feedback``: rewards clients post to the recorder (``/v1/feedback``); it scores nothing itself.
  Its rows carry no version.
- ``grader``: ``package.module:function(trajectory) -> float | None`` on a ``view.TrajectoryView``;
  None means "cannot tell" (the trajectory stays pending). Version: the function's name and a hash
  of its module's source as loaded, so editing the grader makes a new version once a process imports
  the edit (a long-lived process keeps running, and naming, the code it imported: ``loaded_code_hash``).
- ``judge``: an LLM behind an OpenAI-compatible endpoint with a rubric (``judge.JudgeSource``).
- ``command``: any scorer as a command, trajectories in and rewards out as JSON lines
  (``harnesses.command``); ``verifiers``: a verifiers taskset's rubric through it
  (``harnesses.verifiers_tasksets``).
- ``inspect``: an inspect-ai task's scorers on each trajectory's sample (``harnesses.inspect_ai_tasks``).

A source that fails on a trajectory (the grader raises, the judge times out or answers without a
score) leaves it unscored and reports the error; it never stands in a 0.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Callable, Sequence

from prodrl_pipelines.rewards.code_version import loaded_code_hash
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


SOURCE_GROUP = "prodrl_pipelines.reward_sources"
# name -> factory(settings); ``scores``: the source scores stored traffic itself
BUILT_IN: dict = {"feedback": FeedbackSource, "grader": GraderSource, "judge": JudgeSource}


@functools.cache
def _registered() -> dict:
    """The entry points of ``SOURCE_GROUP`` by name, read once per process (settings are validated,
    and sensor ticks ask which sources score, far more often than packages are installed)."""
    return {ep.name: ep for ep in entry_points(group=SOURCE_GROUP)}


def source_names() -> list[str]:
    """Every reward source's name, without importing any harness."""
    return sorted({*BUILT_IN, *_registered()})


def source_factory(name: str):
    """The factory of the source ``name`` (a harness's module is imported here)."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    if name not in _registered():
        raise ValueError(f"unknown reward source {name!r}; known: {', '.join(source_names())}")
    return _registered()[name].load()


def make_source(name: str, settings):
    """The configured source ``name`` (``settings``: ``RewardSettings``)."""
    return source_factory(name)(settings)
