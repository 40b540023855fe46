"""A held-out suite from a JSONL file and a reward function named ``package.module:function``.

One task per line, a JSON object::

    {"task_id": "q17", "messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}

``messages`` (required): the chat messages of the (single) model call; ``task_id`` (optional,
default ``line-<n>``, must be unique); ``tools`` (optional): tool schemas for the chat template;
any other fields are the task's own (answers, test cases, rubrics) and reach the reward function,
which is called as ``reward(task, completions)`` with ``task`` the line's object and ``completions``
the list of assistant texts (one per model call; one here) and returns a float.

Single-turn by design; a multi-turn or tool-calling environment is a suite class
(``package.module:Suite``, see ``suite.EvalSuite``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class JsonlTask:
    task_id: str
    data: dict  # the line's object (messages included)


class JsonlSuite:
    min_max_tokens = 1

    def __init__(self, text: str, source: str, reward_fn: Callable[[dict, list[str]], float], reward_name: str):
        from prodrl_pipelines.evaluation.suite import SuiteError

        self.name = source
        self.reward_name = reward_name
        self._reward = reward_fn
        self._tasks: list[JsonlTask] = []
        seen: dict[str, int] = {}
        tools = None
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{source}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SuiteError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise SuiteError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
            msgs = obj.get("messages")
            if (not isinstance(msgs, list) or not msgs
                    or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)):
                raise SuiteError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}} objects")
            tid = obj.get("task_id", f"line-{n}")
            if not isinstance(tid, str) or not tid:
                raise SuiteError(f"{where}: 'task_id' must be a non-empty string")
            if tid in seen:
                raise SuiteError(f"{where}: duplicate task_id {tid!r} (first on line {seen[tid]})")
            seen[tid] = n
            if obj.get("tools") is not None:
                if not isinstance(obj["tools"], list):
                    raise SuiteError(f"{where}: 'tools' must be a list of tool schemas")
                tools = tuple(obj["tools"])
            self._tasks.append(JsonlTask(tid, obj))
        if not self._tasks:
            raise SuiteError(f"{source}: the held-out set is empty (no task lines)")
        self.tools = tools

    def __len__(self) -> int:
        return len(self._tasks)

    def heldout_tasks(self, n: int) -> list[JsonlTask]:
        return self._tasks[:n]

    def initial_messages(self, task: JsonlTask) -> list[dict]:
        return [dict(m) for m in task.data["messages"]]

    def env_reply(self, task: JsonlTask, turn: int, content: str) -> dict | None:
        return None

    def reward(self, task: JsonlTask, assistant_texts: list[str]) -> float:
        return float(self._reward(task.data, list(assistant_texts)))
