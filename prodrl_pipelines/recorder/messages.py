"""The Anthropic Messages API (``POST /v1/messages``) on top of the upstream's chat completions.

Agents built on Anthropic's SDKs and tools (Claude Code, the Claude Agent SDK, anything speaking
``anthropic``) reach a self-hosted policy through this route. As for the Responses API
(``recorder.responses``), the request is translated to a chat request (what the upstream samples
from, and what gives the exact prompt and output token ids), recorded exactly like a chat call, and
the chat answer or stream is translated back into a Message or Messages stream events.

Translated: ``system`` (a string or text blocks), ``messages`` (text, ``tool_use`` and
``tool_result`` blocks; an assistant turn's ``thinking`` block becomes the chat message's
``reasoning_content``, ``redacted_thinking`` is dropped: it cannot be read), ``max_tokens``,
``stop_sequences`` (chat ``stop``; the Message's ``stop_sequence`` says which one matched),
``temperature``, ``top_p``, ``top_k`` (older clients' fields; newer ones send them as extra body),
client ``tools`` (``input_schema`` as the function's
parameters) and ``tool_choice`` (``auto``, ``any`` = required, ``tool``, ``none``;
``disable_parallel_tool_use``), ``stream``. ``cache_control`` marks are accepted and have no effect;
the fields about Anthropic's service (``metadata``, ``service_tier``, ``speed``, ``inference_geo``, ...)
are accepted and not sent on. The answer's ``reasoning_content``
(a reply parser split it out) comes back as a ``thinking`` block signed by the recorder (``signature``); a tool
call's arguments become ``input`` when they are a JSON object (else ``{}``: the record keeps the
sampled tokens either way). Refused with a 400 naming the field: image, document and other non-text
blocks, server tools (``type`` other than ``custom``), ``mcp_servers``, ``container``, ``output_config``
(structured output and effort: not translated yet), and
``thinking`` when enabled (a thinking budget cannot be enforced by a chat server; a model whose
template thinks does so anyway, and its thinking is returned).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, Iterator

from prodrl_pipelines.engines.openai_protocol import ProtocolError
from prodrl_pipelines.recorder.api_shapes import joined_text, token_counts

__all__ = ["MessagesShape"]

_REFUSED = ("mcp_servers", "container", "output_config")
# accepted and not sent on: about Anthropic's own service (routing, caching, accounting)
_SERVICE = ("metadata", "service_tier", "cache_control", "speed", "inference_geo", "diagnostics", "user_profile_id",
            "workspace_id")
_PASSED_BY_US = {"system", "messages", "max_tokens", "stop_sequences", "tools", "tool_choice", "stream", "thinking",
                 *_SERVICE, *_REFUSED}
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


def _bad(field: str, why: str) -> ProtocolError:
    return ProtocolError(f"/v1/messages: `{field}` {why}")


def _text(content: Any, where: str) -> str:
    return joined_text(content, where, _bad, ("text",), "block")


def _user(content: Any, where: str) -> list[dict]:
    """A user turn: its tool results as tool messages (first, as the API orders them), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise _bad(where, "must be a string or a non-empty list of blocks")
    tools, text = [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{where}[{i}].tool_use_id", "must be a string")
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": _text(block.get("content", ""), f"{where}[{i}].content")})
        elif kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        else:
            raise _bad(f"{where}[{i}]", f"is a {kind!r} block: the recorder takes text and tool_result blocks "
                       "in user turns")
    return tools + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant(content: Any, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of blocks")
    msg: dict = {"role": "assistant", "content": None}
    text, thinking, calls = [], [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            for f in ("id", "name"):
                if not isinstance(block.get(f), str):
                    raise _bad(f"{where}[{i}].{f}", "must be a string")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        else:
            raise _bad(f"{where}[{i}]", f"is a {kind!r} block: the recorder takes text, thinking and tool_use "
                       "blocks in assistant turns")
    if text:
        msg["content"] = "".join(text)
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict) -> list[dict]:
    msgs: list[dict] = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": _text(system, "system")})
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise _bad("messages", "must be a non-empty list")
    for i, m in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object")
        role = m.get("role")
        if role == "user":
            msgs += _user(m.get("content"), f"{where}.content")
        elif role == "assistant":
            msgs.append(_assistant(m.get("content"), f"{where}.content"))
        else:
            raise _bad(f"{where}.role", f"must be user or assistant, got {role!r} (the system prompt is `system`)")
    return msgs


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None) or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"tools[{i}]", f"is a {kind!r} tool: the recorder takes client tools (name, input_schema) only")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(tc: Any, has_tools: bool) -> tuple[Any, bool | None]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls`` for the API's ``tool_choice``."""
    if tc is None:
        return None, None
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice", f"must be an object of type auto, any, tool or none, got {tc!r}")
    parallel = False if tc.get("disable_parallel_tool_use") else None
    kind = tc["type"]
    if kind in ("auto", "none"):
        return (kind if has_tools else None), (parallel if has_tools else None)
    if not has_tools:
        raise _bad("tool_choice", f"{kind!r} forces a tool call, but `tools` holds none")
    if kind == "any":
        return "required", parallel
    if not isinstance(tc.get("name"), str):
        raise _bad("tool_choice.name", "must be a string")
    return {"type": "function", "function": {"name": tc["name"]}}, parallel


def signature(thinking: str) -> str:
    """A thinking block's ``signature``: Anthropic's clients send a thinking block back only with one
    (pydantic-ai turns an unsigned one into a user turn of text), so the recorder signs what it
    returns with a digest of the text (the record holds the tokens: nothing is verified on the way back)."""
    return "prodrl-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesShape:
    """One Messages call: its chat request, and the chat answer (or stream) turned into a Message."""

    def __init__(self, body: dict) -> None:
        for f in _REFUSED:
            if body.get(f):
                raise _bad(f, "is not supported by the recorder's translation to chat")
        thinking = body.get("thinking")
        if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") != "disabled"):
            raise _bad("thinking", "can only be disabled here: a chat server cannot enforce a thinking budget "
                       "(a model whose template thinks still does, and its thinking is returned)")
        if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool) \
                or body["max_tokens"] < 1:
            raise _bad("max_tokens", "is required: a positive integer")
        stops = body.get("stop_sequences")
        if stops is not None and (not isinstance(stops, list) or any(not isinstance(s, str) for s in stops)):
            raise _bad("stop_sequences", "must be a list of strings")
        self.body = body
        self.id = "msg_" + uuid.uuid4().hex
        self.model = body.get("model")
        # streamed: the blocks opened so far (index -> kind), the open one, tool calls by chat index
        self.blocks: list[str] = []
        self.open: int | None = None
        self.calls: dict[int, int] = {}
        self.stop_reason: Any = None  # vLLM's: the stop string that matched
        self.thinking: list[str] = []  # the open thinking block's text (its signature at its end)

    def chat_request(self) -> dict:
        body = self.body
        chat = {k: v for k, v in body.items() if k not in _PASSED_BY_US}
        chat["messages"] = _messages(body)
        chat["max_tokens"] = body["max_tokens"]
        if body.get("stop_sequences"):
            chat["stop"] = body["stop_sequences"]
        tools = _tools(body)
        choice, parallel = _tool_choice(body.get("tool_choice"), tools is not None)
        for name, value in (("tools", tools), ("tool_choice", choice), ("parallel_tool_calls", parallel)):
            if value is not None:
                chat[name] = value
        if body.get("stream"):
            chat["stream"] = True
        return chat

    # ------------------------------------------------------------------ the Message

    def _stop(self, finish: str | None, stop_reason: Any) -> tuple[str | None, str | None]:
        """The API's stop_reason and stop_sequence for a chat finish reason (and vLLM's ``stop_reason``:
        the stop string that matched, or an EOS token id)."""
        if finish == "stop" and isinstance(stop_reason, str) and stop_reason in (self.body.get("stop_sequences") or []):
            return "stop_sequence", stop_reason
        return _STOP.get(finish or "", "end_turn" if finish else None), None

    @staticmethod
    def usage(prompt_ids: list | None, output_ids: list | None, upstream: dict | None) -> dict | None:
        counts = token_counts(prompt_ids, output_ids, upstream)
        if counts is None:
            return None
        n_in, n_out = counts
        return {"input_tokens": n_in, "output_tokens": n_out, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0}

    def message(self, content: list[dict], stop: str | None, stop_sequence: str | None, usage: dict | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": stop_sequence,
                "usage": usage or {"input_tokens": 0, "output_tokens": 0}}

    def answer(self, chat: dict, usage: dict | None) -> dict:
        """The (rewritten) chat answer as a Message."""
        self.model = chat.get("model", self.model)
        choice = chat["choices"][0]
        msg = choice.get("message") or {}
        content = []
        thinking = msg.get("reasoning_content") or msg.get("reasoning")
        if thinking:
            content.append({"type": "thinking", "thinking": thinking, "signature": signature(thinking)})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function") or {}
            content.append({"type": "tool_use", "id": tc.get("id"), "name": fn.get("name"),
                            "input": _input(fn.get("arguments"))})
        stop, seq = self._stop(choice.get("finish_reason"), choice.get("stop_reason"))
        return self.message(content, stop, seq, usage)

    # ------------------------------------------------------------------ streamed

    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **fields}, separators=(",", ":")).encode() \
            + b"\n\n"

    def _start_block(self, kind: str, block: dict) -> Iterator[bytes]:
        yield from self._stop_open()
        self.blocks.append(kind)
        self.open = len(self.blocks) - 1
        yield self._event("content_block_start", index=self.open, content_block=block)

    def _stop_open(self) -> Iterator[bytes]:
        if self.open is not None:
            if self.blocks[self.open] == "thinking":  # as Anthropic's stream: the signature, then the stop
                yield self._event("content_block_delta", index=self.open,
                                  delta={"type": "signature_delta", "signature": signature("".join(self.thinking))})
                self.thinking = []
            yield self._event("content_block_stop", index=self.open)
            self.open = None

    def start_events(self) -> Iterator[bytes]:
        yield self._event("message_start", message=self.message([], None, None, None))
        yield self._event("ping")

    def chunk_events(self, chunk: dict) -> Iterator[bytes]:
        """One (rewritten) chat stream chunk as Messages events: text, thinking and each tool call a block
        of its own, opened when its first piece arrives (the previous one closed)."""
        if not isinstance(chunk, dict):
            return
        self.model = chunk.get("model", self.model)
        for ch in chunk.get("choices") or []:
            delta = ch.get("delta") or {}
            if ch.get("stop_reason") is not None:
                self.stop_reason = ch["stop_reason"]
            # servers send the reasoning as reasoning_content, reasoning, or both (the same text)
            thinking = delta.get("reasoning_content") or delta.get("reasoning")
            for piece, kind, field, dtype in ((thinking, "thinking", "thinking", "thinking_delta"),
                                              (delta.get("content"), "text", "text", "text_delta")):
                if not piece:
                    continue
                if self.open is None or self.blocks[self.open] != kind:
                    block = {"type": kind, field: ""} if kind == "text" else {"type": kind, field: "", "signature": ""}
                    yield from self._start_block(kind, block)
                if kind == "thinking":
                    self.thinking.append(piece)
                yield self._event("content_block_delta", index=self.open, delta={"type": dtype, field: piece})
            for tc in delta.get("tool_calls") or []:
                i = int(tc.get("index", 0))
                fn = tc.get("function") or {}
                if i not in self.calls:
                    yield from self._start_block("tool_use", {"type": "tool_use", "id": tc.get("id"),
                                                              "name": fn.get("name"), "input": {}})
                    self.calls[i] = self.open
                if fn.get("arguments"):
                    yield self._event("content_block_delta", index=self.calls[i],
                                      delta={"type": "input_json_delta", "partial_json": fn["arguments"]})

    def end_events(self, finish: str | None, usage: dict | None) -> Iterator[bytes]:
        yield from self._stop_open()
        stop, seq = self._stop(finish, self.stop_reason)
        yield self._event("message_delta", delta={"stop_reason": stop, "stop_sequence": seq},
                          usage=usage or {"output_tokens": 0})
        yield self._event("message_stop")

    def error_event(self, message: str, code: int) -> bytes:
        kind = {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error",
                529: "overloaded_error"}.get(code, "api_error")
        return self._event("error", error={"type": kind, "message": message})
