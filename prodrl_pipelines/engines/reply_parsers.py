"""What a chat server makes of a model's reply: the assistant message of the API response.

An OpenAI-compatible server does not hand the sampled text back as is: with a reasoning parser and a
tool-call parser (vLLM's ``--reasoning-parser qwen3 --tool-call-parser hermes``) it splits the text
into ``reasoning_content``, ``content`` and structured ``tool_calls`` whose ``arguments`` are JSON
re-serialised by the server. A harness appends that message to its history and the chat template
renders it again on the next call, so what the model sees of its own earlier turn is not what it
sampled. Chosen by name (``REPLY_PARSERS``); ``none`` keeps the text as the message content.
"""

from __future__ import annotations

import json
import re
from typing import Callable

__all__ = ["REPLY_PARSERS", "get_reply_parser", "parse_plain", "parse_qwen3"]

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


def parse_qwen3(text: str) -> dict:
    """Qwen3-style reasoning (``<think>...</think>`` before the answer) and Hermes-style tool calls
    (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).

    Reasoning is what precedes ``</think>`` (without ``<think>`` and surrounding newlines). Tool
    calls are parsed only when every ``<tool_call>`` block holds a valid call; otherwise, as vLLM's
    parser does, the text stays content and ``tool_calls`` is absent. ``content`` is what is left
    before the first call, stripped (None when empty and there are calls).
    """
    reasoning = None
    rest = text
    if THINK_CLOSE in text:
        head, rest = text.split(THINK_CLOSE, 1)
        reasoning = head.split(THINK_OPEN, 1)[-1].strip("\n")
        rest = rest.lstrip("\n")
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
