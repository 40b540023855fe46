"""Someone else's model, built the way a user's would be, without the lab (the README's example builder,
``examples/own_model/build_model.py``), and a user package holding a held-out JSONL grader (one task
of which can make it raise) and a multi-turn, tool-calling suite class."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "own_model"))

from build_model import END, build_model, build_tokenizer  # noqa: E402,F401

GRADER = '''
"""A user's grader package: a JSONL reward function and a multi-turn, tool-calling suite."""
from dataclasses import dataclass


def reward(task, completions):
    if task.get("explode"):
        raise ValueError("grader cannot parse " + task["task_id"])
    return float(completions[-1].strip().startswith(task["answer"][:1]))


@dataclass(frozen=True)
class Task:
    task_id: str
    a: int
    b: int


class ToolSuite:
    """Two model calls: the model asks the calculator tool; the tool's result comes back; it answers."""
    name = "calculator"
    min_max_tokens = 2
    tools = ({"type": "function", "function": {"name": "add", "parameters": {"type": "object",
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},)

    def heldout_tasks(self, n):
        return [Task(f"calc-{i}", i % 7, i % 5) for i in range(min(n, 12))]

    def initial_messages(self, task):
        return [{"role": "system", "content": "use the add tool"}, {"role": "user", "content": f"{task.a}+{task.b}"}]

    def env_reply(self, task, turn, content):
        if turn == 0:
            return {"role": "tool", "content": str(task.a + task.b)}
        return None

    def reward(self, task, assistant_texts):
        assert len(assistant_texts) == 2, assistant_texts
        return 1.0 if str(task.a + task.b) in assistant_texts[-1] else 0.0
'''


def write_user_package(root: Path, n_tasks: int = 10, explode: tuple[int, ...] = ()) -> dict:
    """``root/mygrader/__init__.py`` and ``root/heldout.jsonl``; returns the settings that name them."""
    pkg = root / "mygrader"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(GRADER))
    lines = []
    for i in range(n_tasks):
        a, b = i % 9, (i * 3) % 7
        obj = {"task_id": f"q{i}", "messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        if i in explode:
            obj["explode"] = True
        lines.append(json.dumps(obj))
    (root / "heldout.jsonl").write_text("\n".join(lines) + "\n")
    return {"eval_suite": str(root / "heldout.jsonl"), "eval_reward_fn": "mygrader:reward"}
