"""Your grader package: a reward function for the JSONL held-out set and a multi-turn tool suite."""

from dataclasses import dataclass


def reward(task: dict, completions: list[str]) -> float:
    """1 when the last answer starts with the expected one (``task`` is the JSONL line's object)."""
    return float(completions[-1].strip().startswith(task["answer"]))


@dataclass(frozen=True)
class Task:
    task_id: str
    a: int
    b: int


class CalculatorSuite:
    """Two model calls per task: the model calls the `add` tool, gets its result, then answers."""

    name = "calculator"
    min_max_tokens = 2
    tools = ({"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},)

    def heldout_tasks(self, n: int) -> list[Task]:
        return [Task(f"calc-{i}", i % 7, i % 5) for i in range(min(n, 64))]

    def initial_messages(self, task: Task) -> list[dict]:
        return [{"role": "system", "content": "use the add tool"}, {"role": "user", "content": f"{task.a}+{task.b}"}]

    def env_reply(self, task: Task, turn: int, content: str) -> dict | None:
        return {"role": "tool", "content": str(task.a + task.b)} if turn == 0 else None

    def reward(self, task: Task, assistant_texts: list[str]) -> float:
        return 1.0 if str(task.a + task.b) in assistant_texts[-1] else 0.0
