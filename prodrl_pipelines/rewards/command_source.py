"""Reward sources that hand recorded trajectories to another project's scorer.

- ``command`` (``rewards_command``: a command line): the trajectories go to the command's stdin as
  JSON lines, ``{"trajectory_id", "task_id", "outputs": [assistant text per call], "prompts":
  [rendered prompt per call], "metadata"}``, and it prints one ``{"trajectory_id": ..., "reward":
  <number or null>}`` line per trajectory it scored (``"error"`` optional). A trajectory it skips or
  answers null for stays unscored (pending), and one it fails on reports its error; neither is a 0.
  Version: ``command@<hash of the command line and of the files it names>`` (a script and the modules
  it imports from beside it, a rubric file: ``code_version.files_hash``); a new command line or an
  edited script gives new reward rows beside the old.
- ``verifiers`` (``rewards_verifiers_taskset``): this source with the verifiers bridge as its
  command, run by the verifiers environment's Python; version ``verifiers:<taskset>@<verifiers
  version>+<hash of the taskset's package>`` (``verifiers_suite``).
"""

from __future__ import annotations

import json
import shlex
from typing import Sequence

from prodrl_pipelines.rewards.code_version import files_hash
from prodrl_pipelines.rewards.outcome import Outcome, checked, short_hash
from prodrl_pipelines.rewards.view import TrajectoryView


def trajectory_line(v: TrajectoryView) -> str:
    return json.dumps({"trajectory_id": v.trajectory_id, "task_id": v.task_id, "outputs": list(v.outputs),
                       "prompts": list(v.prompts), "metadata": v.metadata}, default=str)


def outcomes_from_lines(text: str, views: Sequence[TrajectoryView], what: str) -> list[Outcome]:
    """One Outcome per view from the command's answer lines (see the module doc)."""
    from prodrl_pipelines.evaluation.command_suite import parse_lines

    got: dict[str, Outcome] = {}
    for obj in parse_lines(text, what, {"trajectory_id": str}):
        if obj.get("error"):
            got[obj["trajectory_id"]] = Outcome(None, f"{what}: {obj['error']}")
        else:
            got[obj["trajectory_id"]] = checked(obj.get("reward"), what)
    return [got.get(v.trajectory_id, Outcome(None)) for v in views]


class CommandSource:
    name = "command"
    scores = True

    def __init__(self, settings, argv: list[str] | None = None, version: str | None = None) -> None:
        if argv is None:
            if not settings.command.strip():
                raise ValueError("rewards_command: source 'command' needs the command line to run")
            argv = shlex.split(settings.command)
        self.argv = list(argv)
        # the command line and the files it names (the script, its rubric): an edit is a new version
        self.version = version or f"command@{short_hash(shlex.join(self.argv), files_hash(self.argv))}"

    def score(self, views: Sequence[TrajectoryView], progress=None) -> list[Outcome]:
        from prodrl_pipelines.evaluation.command_suite import run_command
        from prodrl_pipelines.evaluation.suite import SuiteError

        if not views:
            return []
        what = f"reward source {self.name!r}"
        try:
            text = run_command(self.argv, {}, what, stdin="".join(trajectory_line(v) + "\n" for v in views))
            out = outcomes_from_lines(text, views, what)
        except SuiteError as e:  # the whole batch failed: every trajectory stays unscored, with why
            out = [Outcome(None, str(e)) for _ in views]
        if progress is not None:
            progress(len(views))
        return out
