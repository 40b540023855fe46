"""The evaluation-suite protocol: what a round needs to know about the user's held-out tasks.

A suite hands out held-out tasks and plays the environment between model calls:

- ``heldout_tasks(n)``: the first ``n`` held-out tasks, always the same ones (the gate pairs the
  candidate's and the live policy's rewards task by task); each has a ``task_id``;
- ``initial_messages(task)``: the chat messages of the first model call;
- ``env_reply(task, turn, content)``: after assistant turn ``turn`` (0-based) answered ``content``,
  the next message (a user turn, or a ``{"role": "tool", ...}`` result) or a list of them, or None
  when the episode ends;
- ``reward(task, assistant_texts)``: the episode's reward (a float; [0, 1] is usual, not required);
- ``tools``: tool schemas for the chat template (or None); ``name``; ``min_max_tokens``: the
  smallest ``max_tokens`` an answer fits in (checked against the settings at load time).
- ``reply_parser`` (optional, default ``none``): how the deployment's chat server turns the model's
  text into the assistant message the harness keeps (``engines.reply_parsers``).

Optional: ``calibration_messages(n, seed)``: prompts for W4A4 activation calibration (default:
the held-out tasks' first messages).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class SuiteError(ValueError):
    """The evaluation suite cannot be loaded; the message names the setting, file or line at fault."""


@runtime_checkable
class EvalSuite(Protocol):
    name: str
    tools: tuple[dict, ...] | None
    min_max_tokens: int

    def heldout_tasks(self, n: int) -> list: ...

    def initial_messages(self, task) -> list[dict]: ...

    def env_reply(self, task, turn: int, content: str) -> dict | list[dict] | None: ...

    def reward(self, task, assistant_texts: list[str]) -> float: ...


REQUIRED = ("heldout_tasks", "initial_messages", "env_reply", "reward")


def missing_members(obj) -> list[str]:
    """The protocol members ``obj`` lacks (callables and attributes); a suite with ``play_served``
    plays its own episodes over HTTP (``served.ServedSuite``) and needs no episode hooks."""
    served = callable(getattr(obj, "play_served", None))
    out = [] if served else [m for m in REQUIRED if not callable(getattr(obj, m, None))]
    out += [a for a in ("name",) if not hasattr(obj, a)]
    return out


def reply_parser(suite) -> str:
    """The name of the suite's reply parser (``engines.reply_parsers``; ``none`` when it names none)."""
    return getattr(suite, "reply_parser", None) or "none"


def calibration_messages(suite, n: int, seed: int) -> list[list[dict]]:
    """Prompts for activation calibration: the suite's own, else its held-out first messages, else
    (a suite whose harness shows no prompts) a few generic ones."""
    return first_messages(suite, n, seed)


# a few prompts for W4A4 calibration and the export smoke test of a suite that shows none
GENERIC_PROMPTS = ("Hello! What can you do?", "What is 17 + 25?", "Name three colours.",
                   "Write one sentence about the sea.")


def is_served(suite) -> bool:
    return callable(getattr(suite, "play_served", None))


def first_messages(suite, n: int, seed: int) -> list[list[dict]]:
    """Prompts standing for the suite's traffic: its own calibration prompts, its held-out tasks'
    first messages, else ``GENERIC_PROMPTS``."""
    own = getattr(suite, "calibration_messages", None)
    if callable(own):
        return list(own(n, seed))[:n]
    if callable(getattr(suite, "initial_messages", None)) and callable(getattr(suite, "heldout_tasks", None)):
        return [suite.initial_messages(t) for t in suite.heldout_tasks(n)]
    return [[{"role": "user", "content": p}] for p in GENERIC_PROMPTS[:n]]

