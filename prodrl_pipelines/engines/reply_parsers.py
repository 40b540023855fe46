"""What a chat server makes of a model's reply: the assistant message of the API response.

An OpenAI-compatible server does not hand the sampled text back as is: with a reasoning parser and a
tool-call parser (vLLM's ``--reasoning-parser qwen3 --tool-call-parser hermes``) it splits the text
into ``reasoning_content``, ``content`` and structured ``tool_calls`` whose ``arguments`` are JSON
re-serialised by the server. A harness appends that message to its history and the chat template
renders it again on the next call, so what the model sees of its own earlier turn is not what it
sampled. Chosen by name (``REPLY_PARSERS``); ``none`` keeps the text as the message content.

``TOOL_FORMATS``: the families whose tool calls ``prodrl serve --reply-parser NAME`` parses and forces
(``ToolFormat``), with the vLLM flags that make a vLLM server parse them the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

__all__ = ["REPLY_PARSERS", "TOOL_FORMATS", "ToolFormat", "get_reply_parser", "parse_plain", "parse_qwen3",
           "reply_parser_flags", "split_qwen3_reasoning"]

ReplyParser = Callable[[str], dict]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_plain(text: str) -> dict:
    """The reply as the message content (a server without reasoning or tool parsers)."""
    return {"role": "assistant", "content": text}


def _tool_call(body: str, index: int) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
        return None
    # the server re-serialises the arguments with its own formatting (json.dumps defaults)
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}}


def split_qwen3_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest): Qwen3's reasoning parser alone (what a server does when it parses no
    tool calls, e.g. ``tool_choice: none``); reasoning is None without ``</think>``."""
    if THINK_CLOSE not in text:
        return None, text
    head, rest = text.split(THINK_CLOSE, 1)
    return head.split(THINK_OPEN, 1)[-1].strip("\n"), rest.lstrip("\n")


def parse_qwen3(text: str) -> dict:
    """Qwen3-style reasoning (``<think>...</think>`` before the answer) and Hermes-style tool calls
    (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).

    Reasoning is what precedes ``</think>`` (without ``<think>`` and surrounding newlines). Tool
    calls are parsed only when every ``<tool_call>`` block holds a valid call; otherwise, as vLLM's
    parser does, the text stays content and ``tool_calls`` is absent. ``content`` is what is left
    before the first call, stripped (None when empty and there are calls).
    """
    reasoning, rest = split_qwen3_reasoning(text)
    msg: dict = {"role": "assistant"}
    blocks = list(_TOOL_CALL.finditer(rest))
    calls = [_tool_call(m.group(1), i) for i, m in enumerate(blocks)]
    if blocks and all(c is not None for c in calls):
        content = rest[: blocks[0].start()].strip()
        msg["content"] = content or None
        msg["tool_calls"] = calls
    else:
        msg["content"] = rest
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


REPLY_PARSERS: dict[str, ReplyParser] = {"none": parse_plain, "qwen3": parse_qwen3}


def get_reply_parser(name: str) -> ReplyParser:
    if name not in REPLY_PARSERS:
        raise ValueError(f"unknown reply parser {name!r}; valid parsers: {', '.join(sorted(REPLY_PARSERS))}")
    return REPLY_PARSERS[name]


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes reasoning and tool calls: the parser of its replies, how a call is
    opened (``prodrl serve`` forces a tool choice by ending the prompt with the opening of a call and
    letting the model write the rest) and the vLLM flags of the same parsers."""

    name: str
    parse: ReplyParser  # reasoning and tool calls
    reasoning: Callable[[str], tuple[str | None, str]]  # reasoning alone: (reasoning or None, the rest)
    call_start: str  # what opens a call block
    call_end: str  # what closes it
    vllm_args: tuple[str, ...]

    def call_text(self, function: str, arguments: dict) -> str:
        """One call as the model writes it (and the chat template renders it: ``tojson`` spacing)."""
        return self.call_start + json.dumps({"name": function, "arguments": arguments}, ensure_ascii=False) + self.call_end

    def opening(self, function: str | None) -> str:
        """The start of a call: up to the function's name (``None``: the model writes the name), or
        of the named function up to its arguments. A prefix of ``call_text``."""
        if function is None:
            return self.call_start + '{"name": "'
        return self.call_start + '{"name": ' + json.dumps(function, ensure_ascii=False) + ', "arguments": '


# Qwen3 (and Hermes-style models): vLLM parses them with these flags
QWEN3 = ToolFormat("qwen3", parse_qwen3, split_qwen3_reasoning, "<tool_call>\n", "\n</tool_call>",
                   ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"))
TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (QWEN3,)}


def reply_parser_flags(name: str, vllm: bool) -> list[str]:
    """The flags that make a server parse replies in the format ``name`` (``none``: none): vLLM's
    parser flags, or ``prodrl serve --reply-parser``."""
    if name == "none":
        return []
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown reply parser {name!r}; valid: none, {', '.join(sorted(TOOL_FORMATS))}")
    return list(TOOL_FORMATS[name].vllm_args) if vllm else ["--reply-parser", name]
