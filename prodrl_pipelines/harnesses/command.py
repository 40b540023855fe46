"""The command harness: any program as a held-out suite and as a reward source.

**Suite** (``eval_suite: "command:<command line>"``).

The command is given the served policy's OpenAI-compatible base URL and the deployment's sampling
settings in its environment and prints one JSON object per task on stdout::

    {"task_id": "q1", "reward": 1.0, "outputs": ["4"], "tags": ["easy"], "gen_tokens": 3}

``task_id`` and ``reward`` are required; ``outputs`` (the assistant texts, what the monitors and a
reviewer read), ``tags`` (the per-tag slices), ``error`` (the harness failed this task: scored 0)
and ``gen_tokens`` are optional. Environment: ``PRODRL_BASE_URL`` (ends in ``/v1``; also
``OPENAI_BASE_URL``), ``PRODRL_MODEL``, ``PRODRL_API_KEY`` (also ``OPENAI_API_KEY``),
``PRODRL_NUM_TASKS`` (play the first this many held-out tasks, always the same ones, in the same
order), ``PRODRL_SEED``, ``PRODRL_TEMPERATURE``, ``PRODRL_TOP_P``, ``PRODRL_TOP_K``,
``PRODRL_MAX_TOKENS``. A non-zero exit, a line that is not such an object, or a run longer than
``PRODRL_EVAL_COMMAND_TIMEOUT_S`` (default 3600) fails the evaluation naming the command and line.

``verifiers:<taskset>`` is this suite with the verifiers bridge as its command, run by the
verifiers environment's Python (``verifiers_tasksets``, ``verifiers_bridge``).

**Reward source** (``rewards_sources: [command]``, ``rewards_command``: a command line): the
trajectories go to the command's stdin as JSON lines, ``{"trajectory_id", "task_id", "outputs":
[assistant text per call], "prompts": [rendered prompt per call], "metadata"}``, and it prints one
``{"trajectory_id": ..., "reward": <number or null>}`` line per trajectory it scored (``"error"``
optional). A trajectory it skips or answers null for stays unscored (pending), and one it fails on
reports its error; neither is a 0. Version: ``command@<hash of the command line and of the files it
names>`` (a script and the modules it imports from beside it, a rubric file:
``code_version.files_hash``); a new command line or an edited script gives new reward rows beside
the old.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
from typing import Sequence

from prodrl_pipelines.evaluation.served import ServedEndpoint, ServedEpisode
from prodrl_pipelines.evaluation.suite import SuiteError
from prodrl_pipelines.rewards.code_version import files_hash
from prodrl_pipelines.rewards.outcome import Outcome, checked, short_hash
from prodrl_pipelines.rewards.view import TrajectoryView

DEFAULT_TIMEOUT_S = 3600.0


def run_command(argv: list[str], env: dict, what: str, stdin: str | None = None) -> str:
    """Run ``argv`` with ``env`` added; its stdout, or a ``SuiteError`` naming ``what`` and the
    command's last stderr lines."""
    timeout = float(os.environ.get("PRODRL_EVAL_COMMAND_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **env})
    except FileNotFoundError:
        raise SuiteError(f"{what}: command not found: {argv[0]!r}") from None
    except subprocess.TimeoutExpired:
        raise SuiteError(f"{what}: {shlex.join(argv)} ran past {timeout:.0f} s "
                         "(PRODRL_EVAL_COMMAND_TIMEOUT_S)") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SuiteError(f"{what}: {shlex.join(argv)} exited {proc.returncode}:\n{tail}")
    return proc.stdout


def parse_lines(text: str, what: str, required: dict[str, type]) -> list[dict]:
    """The JSON objects of ``text``, one per non-blank line, each with the ``required`` fields."""
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise SuiteError(f"{what}: stdout line {n} is not JSON: {line[:200]!r}") from None
        if not isinstance(obj, dict):
            raise SuiteError(f"{what}: stdout line {n} is not a JSON object: {line[:200]!r}")
        for key, typ in required.items():
            if not isinstance(obj.get(key), typ) or isinstance(obj.get(key), bool):
                raise SuiteError(f"{what}: stdout line {n}: {key!r} must be {typ.__name__ if isinstance(typ, type) else 'a number'}, "
                                 f"got {obj.get(key)!r}")
        out.append(obj)
    return out


def episodes_from_lines(text: str, what: str) -> list[ServedEpisode]:
    eps = []
    for obj in parse_lines(text, what, {"task_id": str, "reward": (int, float)}):
        reward = float(obj["reward"])
        if not math.isfinite(reward):
            raise SuiteError(f"{what}: task {obj['task_id']!r}: reward {obj['reward']!r} is not finite")
        outputs, tags = obj.get("outputs") or [], obj.get("tags") or []
        if not isinstance(outputs, list) or not all(isinstance(t, str) for t in outputs):
            raise SuiteError(f"{what}: task {obj['task_id']!r}: 'outputs' must be a list of strings")
        gen = obj.get("gen_tokens")
        eps.append(ServedEpisode(obj["task_id"], 0.0 if obj.get("error") else reward, outputs,
                                 [str(t) for t in tags], str(obj["error"]) if obj.get("error") else None,
                                 int(gen) if isinstance(gen, int) else None))
    return eps


def endpoint_env(endpoint: ServedEndpoint, n: int, params, seed: int) -> dict:
    return {"PRODRL_BASE_URL": endpoint.base_url, "OPENAI_BASE_URL": endpoint.base_url,
            "PRODRL_MODEL": endpoint.model, "PRODRL_API_KEY": endpoint.api_key, "OPENAI_API_KEY": endpoint.api_key,
            "PRODRL_NUM_TASKS": str(n), "PRODRL_SEED": str(seed), "PRODRL_TEMPERATURE": repr(params.temperature),
            "PRODRL_TOP_P": repr(params.top_p), "PRODRL_TOP_K": str(params.top_k),
            "PRODRL_MAX_TOKENS": str(params.max_tokens)}


class CommandSuite:
    """The held-out suite an external command plays (see the module doc)."""

    min_max_tokens = 1
    tools = None

    def __init__(self, argv: list[str], name: str) -> None:
        if not argv:
            raise SuiteError("eval_suite='command:': name the command to run after 'command:'")
        self.argv = list(argv)
        self.name = name

    def play_served(self, endpoint: ServedEndpoint, n: int, params, seed: int) -> list[ServedEpisode]:
        what = f"eval_suite={self.name!r}"
        return episodes_from_lines(run_command(self.argv, endpoint_env(endpoint, n, params, seed), what), what)


def command_suite(arg: str, settings=None) -> CommandSuite:
    """The ``command`` suite source: ``command:<command line>`` (split as a shell would, not run by one)."""
    try:
        argv = shlex.split(arg)
    except ValueError as e:
        raise SuiteError(f"eval_suite='command:{arg}': cannot split the command line ({e})") from None
    return CommandSuite(argv, f"command:{arg}")


# ------------------------------------------------------------------ the reward source

def trajectory_line(v: TrajectoryView) -> str:
    return json.dumps({"trajectory_id": v.trajectory_id, "task_id": v.task_id, "outputs": list(v.outputs),
                       "prompts": list(v.prompts), "metadata": v.metadata}, default=str)


def outcomes_from_lines(text: str, views: Sequence[TrajectoryView], what: str) -> list[Outcome]:
    """One Outcome per view from the command's answer lines (see the module doc)."""
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
