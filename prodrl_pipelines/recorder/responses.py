"""The OpenAI Responses API (``POST /v1/responses``) on top of the upstream's chat completions.

The recorder records a Responses call exactly like a chat call: the request is translated to a chat
request (what the upstream samples from, and what gives the exact prompt and output token ids), and
the chat answer or stream is translated back into a Response object or Responses stream events.
This works in front of any upstream with chat completions (vLLM, ``prodrl serve``), and the record
has the same fields as a chat call's.

Translated: ``input`` (a string, or message items with text content parts, ``function_call`` and
``function_call_output`` items), ``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``,
function ``tools`` (each with its ``strict`` flag) and ``tool_choice``, ``parallel_tool_calls``
(``false`` included), ``text.format`` (text or JSON schema), ``top_logprobs`` with ``include:
["message.output_text.logprobs"]``, ``stream``; other fields (``seed``, vLLM's ``top_k``, ...) go to
the chat request as they are, so the usual unrecordable rules apply. What agent SDKs send by default
works: ``tools: []`` (openai-agents always sends it; vLLM refuses an empty array) is left out, with a
``tool_choice`` of ``auto`` or ``none`` (the same thing without tools); ``store`` (nothing is kept
either way: the Response says ``store: false``) and ``metadata`` are accepted and not sent on; any
``include`` value of the API is accepted: the others select output the translation never produces
(reasoning items, built-in tool results, input images). Refused with a 400 naming the field:
server-side state (``previous_response_id``, ``conversation``, ``background``, ``prompt``: the recorder
keeps no Response, so the client must send the whole conversation as ``input``), built-in tools,
non-text input parts, ``reasoning``, a forced ``tool_choice`` without tools, unknown ``include`` values.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

from prodrl_pipelines.engines.openai_protocol import ProtocolError
from prodrl_pipelines.recorder.api_shapes import joined_text, token_counts

__all__ = ["ResponsesShape", "LOGPROBS_INCLUDE", "INCLUDABLE"]

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The Responses API's ``include`` values (openai ``ResponseIncludable``); only LOGPROBS_INCLUDE changes
# the answer, the others select items a translated chat answer never has.
INCLUDABLE = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results",
                        "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                        "computer_call_output.output.image_url", "code_interpreter_call.outputs"})
_STATEFUL = ("previous_response_id", "conversation", "background", "prompt")
_PASSED_BY_US = {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "top_logprobs", "include",
                 "stream", "store", "metadata", "user", "parallel_tool_calls", "truncation", "service_tier",
                 "prompt_cache_key", "safety_identifier", "stream_options", "reasoning", "max_tool_calls", *_STATEFUL}


def _bad(field: str, why: str) -> ProtocolError:
    return ProtocolError(f"/v1/responses: `{field}` {why}")


def _text_of(content: Any, where: str) -> str:
    return joined_text(content, where, _bad, ("input_text", "output_text", "text"), "part")


def _messages(body: dict) -> list[dict]:
    msgs: list[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _bad("instructions", "must be a string")
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role", f"must be user, system, developer or assistant, got {role!r}")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for f in ("call_id", "name", "arguments"):
                if not isinstance(item.get(f), str):
                    raise _bad(f"{where}.{f}", "must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                # one assistant turn: parallel calls, and the message item a streamed answer opens before
                # its calls (empty when the answer is calls only; clients send it back)
                msgs[-1].setdefault("tool_calls", []).append(call)
                if not msgs[-1]["content"]:
                    msgs[-1]["content"] = None
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}.call_id", "must be a string")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text_of(item.get("output"), f"{where}.output")})
        else:
            raise _bad(f"{where}.type", f"{kind!r} items are not supported (message, function_call, "
                       "function_call_output)")
    return msgs


def _tools(body: dict) -> list[dict] | None:
    """The function tools as chat tools; None for none (``tools: []`` too: vLLM refuses an empty array)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list")
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"tools[{i}]", f"is a {kind!r} tool: the recorder takes function tools only")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        for name in ("description", "strict"):
            if t.get(name) is not None:
                fn[name] = t[name]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any, has_tools: bool) -> Any:
    if tc is None or tc in ("auto", "none"):
        # without tools both mean no call, and a chat server refuses a tool_choice without tools
        return tc if has_tools else None
    if tc == "required" or (isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str)):
        if not has_tools:
            raise _bad("tool_choice", f"{tc!r} forces a tool call, but `tools` holds no function tool")
        return tc if tc == "required" else {"type": "function", "function": {"name": tc["name"]}}
    raise _bad("tool_choice", f"must be auto, none, required or a function, got {tc!r}")


def _response_format(text: Any) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
        raise _bad("text.format", "must be text, json_schema or json_object")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return {"type": fmt["type"]}


class ResponsesShape:
    """One Responses call: its chat request, and the chat answer (or stream) turned into a Response."""

    def __init__(self, body: dict) -> None:
        for f in _STATEFUL:
            if body.get(f):
                raise _bad(f, "needs server-side state, which the recorder keeps none of: send the whole "
                           "conversation as `input`")
        reasoning = body.get("reasoning")
        if reasoning is not None and (not isinstance(reasoning, dict)
                                      or not isinstance(reasoning.get("effort") or "", str)):
            raise _bad("reasoning", "must be an object with an optional string `effort` (and `summary`)")
        include = body.get("include") or []
        if not isinstance(include, list) or any(not isinstance(x, str) for x in include):
            raise _bad("include", "must be a list of strings")
        unknown = sorted(set(include) - INCLUDABLE)
        if unknown:
            raise _bad("include", f"holds {unknown[0][:80]!r}, not a value of the Responses API "
                       f"({', '.join(sorted(INCLUDABLE))})")
        self.body = body
        self.logprobs = LOGPROBS_INCLUDE in include or body.get("top_logprobs") is not None
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.seq = 0
        self.text: list[str] = []
        self.lps: list = []
        self.tool_calls: dict[int, dict] = {}
        self.model = body.get("model")

    def chat_request(self) -> dict:
        body = self.body
        chat = {k: v for k, v in body.items() if k not in _PASSED_BY_US}
        chat["messages"] = _messages(body)
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        tools = _tools(body)
        for name, value in (("tools", tools), ("tool_choice", _tool_choice(body.get("tool_choice"), tools is not None)),
                            ("parallel_tool_calls", body.get("parallel_tool_calls")),
                            ("response_format", _response_format(body.get("text")))):
            if value is not None:
                chat[name] = value
        if self.logprobs:
            chat["logprobs"] = True
            chat["top_logprobs"] = body.get("top_logprobs") or 0
        if body.get("stream"):
            chat["stream"] = True
        # the effort reaches the server as chat's reasoning_effort; no reasoning summary comes back
        effort = (body.get("reasoning") or {}).get("effort")
        if effort:
            chat["reasoning_effort"] = effort
        return chat

    # ------------------------------------------------------------------ the Response object

    def _text_part(self, text: str, lps: list | None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if self.logprobs:
            part["logprobs"] = lps or []
        return part

    def _message(self, text: str, lps: list | None) -> dict:
        return {"type": "message", "id": self.msg_id, "status": "completed", "role": "assistant",
                "content": [self._text_part(text, lps)]}

    @staticmethod
    def _function_calls(tool_calls: list[dict]) -> list[dict]:
        out = []
        for tc in tool_calls:
            fn = tc.get("function") or {}
            out.append({"type": "function_call", "id": "fc_" + str(tc.get("id", "")), "call_id": tc.get("id"),
                        "name": fn.get("name"), "arguments": fn.get("arguments") or "", "status": "completed"})
        return out

    def response(self, output: list[dict], finish: str | None, usage: dict | None, status: str | None = None) -> dict:
        """The Response object; ``status`` defaults to what ``finish`` (the chat finish reason) means."""
        b = self.body
        status = status or ("incomplete" if finish == "length" else "completed")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature"), "top_p": b.get("top_p"), "top_logprobs": b.get("top_logprobs"),
            "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice") or "auto",
            "parallel_tool_calls": b.get("parallel_tool_calls", True), "previous_response_id": None,
            "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": b.get("metadata") or {}, "store": False, "usage": usage,
        }

    @staticmethod
    def usage(prompt_ids: list | None, output_ids: list | None, upstream: dict | None) -> dict | None:
        counts = token_counts(prompt_ids, output_ids, upstream)
        if counts is None:
            return None
        n_in, n_out = counts
        return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}

    def answer(self, chat: dict, usage: dict | None) -> dict:
        """The (rewritten) chat answer as a Response object."""
        self.model = chat.get("model", self.model)
        choice = chat["choices"][0]
        msg = choice.get("message") or {}
        lp = choice.get("logprobs") or {}
        text, calls = msg.get("content") or "", msg.get("tool_calls") or []
        out = ([self._message(text, lp.get("content"))] if text or not calls else []) + self._function_calls(calls)
        return self.response(out, choice.get("finish_reason"), usage)

    # ------------------------------------------------------------------ streamed

    def _event(self, kind: str, **fields) -> bytes:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"

    def start_events(self) -> Iterator[bytes]:
        yield self._event("response.created", response=self.response([], None, None, "in_progress"))
        yield self._event("response.in_progress", response=self.response([], None, None, "in_progress"))
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})

    def chunk_events(self, chunk: dict) -> Iterator[bytes]:
        """One (rewritten) chat stream chunk as Responses events."""
        if not isinstance(chunk, dict):
            return
        self.model = chunk.get("model", self.model)
        for ch in chunk.get("choices") or []:
            delta = ch.get("delta") or {}
            lps = (ch.get("logprobs") or {}).get("content") or []
            self.lps.extend(lps)
            for tc in delta.get("tool_calls") or []:
                acc = self.tool_calls.setdefault(int(tc.get("index", 0)), {"id": None, "function": {"name": "", "arguments": ""}})
                acc["id"] = tc.get("id") or acc["id"]
                fn = tc.get("function") or {}
                acc["function"]["name"] += fn.get("name") or ""
                acc["function"]["arguments"] += fn.get("arguments") or ""
            text = delta.get("content")
            if text:
                self.text.append(text)
                fields = {"logprobs": lps} if self.logprobs else {}
                yield self._event("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                                  delta=text, **fields)

    def end_events(self, finish: str | None, usage: dict | None) -> Iterator[bytes]:
        text = "".join(self.text)
        yield self._event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0, text=text,
                          **({"logprobs": self.lps} if self.logprobs else {}))
        yield self._event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                          part=self._text_part(text, self.lps))
        # the message item opened at the start stays, even when the answer is tool calls only
        output = [self._message(text, self.lps)] + self._function_calls([self.tool_calls[i] for i in sorted(self.tool_calls)])
        yield self._event("response.output_item.done", output_index=0, item=output[0])
        for i, item in enumerate(output[1:], start=1):
            yield self._event("response.output_item.added", output_index=i, item={**item, "status": "in_progress"})
            yield self._event("response.output_item.done", output_index=i, item=item)
        done = self.response(output, finish, usage)
        yield self._event(f"response.{done['status']}", response=done)

    def error_event(self, message: str, code: int) -> bytes:
        return self._event("error", code=str(code), message=message, param=None)
