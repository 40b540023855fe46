"""What a grader or judge sees of one trajectory: the same view whether it was recorded from live
traffic or played by the held-out evaluation.

``outputs`` are the assistant texts, one per model call (what a suite's reward function gets);
``prompts`` the rendered prompt of each call (the conversation as the model saw it); ``tool_calls``
the calls each output parsed into (Hermes ``<tool_call>`` blocks; an unparsable block makes that
call's entry ``None``); ``metadata`` what else the store knows (policy version, call count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from prodrl_pipelines.engines.reply_parsers import parse_qwen3

TOOL_CALL_OPEN = "<tool_call>"


def parsed_tool_calls(text: str) -> list[dict] | None:
    """The tool calls of one output ([] when it makes none; None when a ``<tool_call>`` block does
    not parse, as a chat server's parser would leave it as plain content)."""
    if TOOL_CALL_OPEN not in text:
        return []
    msg = parse_qwen3(text)
    return msg.get("tool_calls")


@dataclass(frozen=True)
class TrajectoryView:
    trajectory_id: str
    task_id: str
    outputs: tuple[str, ...]
    prompts: tuple[str, ...] = ()
    metadata: dict = field(default_factory=dict)

    @property
    def tool_calls(self) -> list[list[dict] | None]:
        return [parsed_tool_calls(o) for o in self.outputs]

    @property
    def transcript(self) -> str:
        """The whole conversation as rendered for the last call, with its output."""
        return (self.prompts[-1] if self.prompts else "") + (self.outputs[-1] if self.outputs else "")


def views_from_calls(calls: pa.Table) -> list[TrajectoryView]:
    """One view per trajectory of a CALL_SCHEMA table (calls in ``call_index`` order), in order of
    first appearance."""
    cols = {c: calls.column(c).to_pylist() for c in
            ("trajectory_id", "call_index", "task_id", "policy_version", "prompt_text", "output_text")}
    by: dict[str, list[int]] = {}
    for i, tid in enumerate(cols["trajectory_id"]):
        by.setdefault(tid, []).append(i)
    out = []
    for tid, rows in by.items():
        rows.sort(key=lambda i: cols["call_index"][i])
        first = rows[0]
        out.append(TrajectoryView(
            trajectory_id=tid, task_id=cols["task_id"][first] or "",
            outputs=tuple(cols["output_text"][i] or "" for i in rows),
            prompts=tuple(cols["prompt_text"][i] or "" for i in rows),
            metadata={"policy_version": cols["policy_version"][first], "num_calls": len(rows)},
        ))
    return out
