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

THINK_OPEN, THINK_CLOSE, CALL_OPEN = "<think>", "</think>", "<tool_call>"
_REASONING_MARKUP = re.compile(r"(<think>|</think>|<tool_call>)")
# vLLM's hermes parser: the last block may be unclosed (a reply cut right after the JSON)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_plain(text: str) -> dict:
    """The reply as the message content (a server without reasoning or tool parsers)."""
    return {"role": "assistant", "content": text}


def _tool_call(body: str | None, index: int) -> dict | None:
    try:
        obj = json.loads(body)
    except (TypeError, ValueError):
        return None
    # vLLM takes any JSON value as the arguments; a missing one, or a name that is not a string, fails the parse
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    # the server re-serialises the arguments with its own formatting (json.dumps defaults)
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}}


def split_qwen3_reasoning(text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, the rest): vLLM 0.32's qwen3 reasoning parser alone (what a server does when it
    parses no tool calls, e.g. ``tool_choice: none``).

    The reply is reasoning up to the first ``</think>`` (dropped) or ``<tool_call>`` (kept, the start
    of the rest): a reply with neither, cut mid-thought or one whose prompt opened ``<think>``, is all
    reasoning. ``<think>`` is dropped while in reasoning, and so is every later ``</think>``. Nothing is
    stripped; an empty part is None. ``thinking=False`` (the request's ``chat_template_kwargs``
    ``enable_thinking: false``): no reasoning, the text as it is."""
    if not thinking:
        return None, text
    reasoning: list[str] = []
    rest: list[str] = []
    in_reasoning = True
    for piece in _REASONING_MARKUP.split(text):
        if piece == THINK_CLOSE:
            in_reasoning = False
        elif not (piece == THINK_OPEN and in_reasoning):
            if piece == CALL_OPEN:
                in_reasoning = False
            (reasoning if in_reasoning else rest).append(piece)
    return "".join(reasoning) or None, "".join(rest) or None


def parse_qwen3(text: str, thinking: bool = True) -> dict:
    """Qwen3-style reasoning (``<think>...</think>`` before the answer) and Hermes-style tool calls
    (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), as vLLM 0.32's qwen3 reasoning
    parser and hermes tool-call parser split a whole reply.

    Reasoning as ``split_qwen3_reasoning`` has it. Tool calls are parsed from the rest only when every
    ``<tool_call>`` block holds a valid call; otherwise, as vLLM's parser does, the rest stays content
    and ``tool_calls`` is absent. With calls, ``content`` is what precedes the first one (None when
    blank); text after the calls is dropped.
    """
    reasoning, rest = split_qwen3_reasoning(text, thinking)
    msg: dict = {"role": "assistant"}
    calls = None
    if rest is not None and CALL_OPEN in rest:
        calls = [_tool_call(m.group(1) or m.group(2), i) for i, m in enumerate(_TOOL_CALL.finditer(rest))]
    if calls and all(c is not None for c in calls):
        head = rest[: rest.index(CALL_OPEN)]
        msg["content"] = head if head.strip() else None
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
    parse: Callable[..., dict]  # reasoning and tool calls; ``thinking=False``: no reasoning
    reasoning: Callable[..., tuple[str | None, str | None]]  # reasoning alone: (reasoning, the rest), None: empty
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
