"""Tools in ``prodrl serve``'s chat endpoint (DESIGN.md s.7): ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked as vLLM 0.32 checks them (same messages), the messages normalised
as vLLM normalises them before the chat template, a forced tool choice turned into the opening of a
call, and the sampled text turned into the assistant message.

* ``tool_choice``: ``none``, ``auto`` (the default when ``tools`` is given), ``required`` or
  ``{"type": "function", "function": {"name": ...}}``. Anything but ``none`` needs the server's
  reply parser (``prodrl serve --reply-parser NAME``, ``reply_parsers.TOOL_FORMATS``), as vLLM
  needs ``--enable-auto-tool-choice --tool-call-parser`` for ``auto``.
* Forced choices: vLLM forces ``required`` and a named function with guided decoding. ``prodrl
  serve`` has no constrained decoding: it ends the prompt with the opening of a call in the model's
  own format (``ToolFormat.opening``: ``<tool_call>\\n{"name": "`` for ``required``, up to
  ``"arguments":`` for a named function) and the model writes the rest. The opening is prompt
  tokens, so what the server returns (and a recorder records) is exactly what was sampled; it is cut
  back to a pre-tokenizer boundary (``forced_opening``), so that the prompt plus the model's canonical
  continuation tokenizes as the whole call would. Nothing makes the model close the call: a reply
  that does not parse stays content, without ``tool_calls``.
* The reply: reasoning (``reasoning``, and the same text as ``reasoning_content``, the older name
  some clients read) and tool calls parsed from the text; each call gets a fresh id
  (``chatcmpl-tool-<hex>``, as vLLM); ``parallel_tool_calls: false`` keeps the first call;
  ``finish_reason`` is ``tool_calls`` when calls were parsed for ``auto`` or ``required`` and the
  model stopped, the engine's own for a named function (vLLM's rules, except that vLLM also says
  ``tool_calls`` for ``auto`` calls before a cut at ``max_tokens``: here ``tool_calls`` always means
  the last sampled token is the stop token, which the recorder relies on).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from prodrl_pipelines.engines.openai_protocol import ProtocolError, message_content
from prodrl_pipelines.engines.reply_parsers import TOOL_FORMATS, ToolFormat

__all__ = ["ToolPlan", "Reply", "plan_tools", "normalize_messages", "forced_opening", "reply_message", "stream_delta",
           "NO_TOOLS"]

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools resolved: the definitions for the template, the choice and the reply format."""

    tools: list[dict] | None  # the tool definitions the template renders (None: the request has none)
    choice: str  # none | auto | required | named
    function: str | None  # the named function (choice ``named``)
    parallel: bool
    fmt: ToolFormat | None  # the server's reply parser (None: the reply is plain content)

    @property
    def forced(self) -> bool:
        return self.choice in (REQUIRED, NAMED)


NO_TOOLS = ToolPlan(None, NONE, None, True, None)


# ----------------------------------------------------------------------------- request


def _bad(message: str, param: str) -> ProtocolError:
    return ProtocolError(message, param=param)


def _tool_dicts(tools) -> list[dict]:
    """The tool definitions as vLLM dumps them for the template (type, and the function's name,
    description and parameters, None when absent, beside any other field the client sent)."""
    if not isinstance(tools, list):
        raise _bad("tools: Input should be a valid list", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict):
            raise _bad(f"{where}: Input should be a valid dictionary", "tools")
        if t.get("type", "function") != "function":
            raise _bad(f"{where}.type: Input should be 'function'", "tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function: Input should be a valid dictionary", "tools")
        if not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.function.name: Input should be a valid string", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description: Input should be a valid string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"{where}.function.parameters: Input should be a valid dictionary", "tools")
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description"),
                                                      "parameters": fn.get("parameters"), **fn}})
    return out


def _named(choice: dict, tools: list[dict]) -> str:
    fn = choice.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"Invalid value for `function`: `{fn}` in `tool_choice`! {_USAGE}", "tool_choice.function")
    if "name" not in fn:
        raise _bad(f"Expected field `name` in `function` in `tool_choice`! {_USAGE}", "tool_choice.function.name")
    name = fn["name"]
    if not isinstance(name, str) or not name:
        raise _bad(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}", "tool_choice.function.name")
    if not any(t["function"]["name"] == name for t in tools):
        raise _bad("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
    if choice.get("type", "function") != "function":
        raise _bad("tool_choice.type: Input should be 'function'", "tool_choice")
    return name


def plan_tools(fields: dict, fmt: ToolFormat | None) -> ToolPlan:
    """The request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (``fields``: the request's
    extra fields) checked in vLLM's order with vLLM's messages; a 400 ``ProtocolError`` otherwise.
    ``fmt``: the server's reply parser, needed by every choice but ``none``."""
    tools = fields.get("tools")
    if tools == []:
        raise _bad("`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                   "tools")
    if tools is not None:
        tools = _tool_dicts(tools)
    parallel = fields.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls: Input should be a valid boolean", "parallel_tool_calls")
    tc = fields["tool_choice"] if "tool_choice" in fields else (AUTO if tools else NONE)
    function = None
    if tc is None or tc == NONE:
        choice = NONE
    else:
        if tools is None:
            raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if tc == AUTO or tc == REQUIRED:
            choice = tc
        elif isinstance(tc, dict):
            choice, function = NAMED, _named(tc, tools)
        else:
            raise _bad(f'Invalid value for `tool_choice`: {tc}! Only named tools, "none", "auto" or "required" '
                       "are supported.", "tool_choice")
        if fmt is None:
            label = "named" if choice == NAMED else choice
            raise _bad(f'"{label}" tool choice requires prodrl serve to be started with --reply-parser '
                       f"({', '.join(sorted(TOOL_FORMATS))}): the parser of the model's tool calls", "tool_choice")
    return ToolPlan(tools, choice, function, parallel is not False, fmt)


def _call_for_template(tc, where: str) -> dict:
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        raise _bad(f"{where}.function: Input should be a valid dictionary", "messages")
    fn = dict(tc["function"])
    if not isinstance(fn.get("name"), str):
        raise _bad(f"{where}.function.name: Input should be a valid string", "messages")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:  # vLLM: a string that is not JSON (empty, malformed) becomes {}
            fn["arguments"] = {}
    elif not isinstance(args, (dict, list)):
        fn["arguments"] = {}
    return {**tc, "function": fn}


def normalize_messages(messages: list[dict]) -> list[dict]:
    """The conversation as vLLM hands it to the chat template: text content (parts joined by new
    lines); assistant ``tool_calls`` with their ``arguments`` parsed from JSON strings (a malformed
    string becomes ``{}``; an empty list is dropped) and echoed reasoning kept as ``reasoning`` and
    ``reasoning_content`` (either name accepted); a tool result's ``tool_call_id``; a string ``name``."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        msg = {"role": role, "content": message_content(m.get("content"))}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise _bad(f"messages.{i}.tool_calls: Input should be a valid list", "messages")
                if calls:
                    msg["tool_calls"] = [_call_for_template(tc, f"messages.{i}.tool_calls.{j}")
                                         for j, tc in enumerate(calls)]
            reasoning = m.get("reasoning")
            if reasoning is None:
                reasoning = m.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise _bad(f"messages.{i}.reasoning: Input should be a valid string", "messages")
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _pretoken_ends(tokenizer, text: str) -> set[int] | None:
    """Where the tokenizer's pre-tokenizer ends a piece of ``text`` (None: no fast pre-tokenizer)."""
    pre = getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None)
    if pre is None:
        return None
    return {end for _, (_, end) in pre.pre_tokenize_str(text)}


def forced_opening(plan: ToolPlan, tokenizer, prompt: str, add_special_tokens: bool = False) -> str:
    """What a forced tool choice appends to the rendered ``prompt``: the opening of a call in the
    model's format, cut back to where the pre-tokenizer ends a piece of the whole call's text and
    ``prompt + opening`` tokenizes as a prefix of ``prompt`` + the whole call (so the model's
    canonical continuation gives the ids the template's text would: e.g. a byte-level BPE joins the
    space after ``"arguments":`` to the ``{`` that follows, so that space is left to the model).
    "" when the choice is not forced."""
    if not plan.forced or plan.fmt is None or not plan.tools:
        return ""
    name = plan.function or plan.tools[0]["function"]["name"]
    whole = plan.fmt.call_text(name, {"a": 1})
    ends = _pretoken_ends(tokenizer, whole)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    target = encode(prompt + whole)
    for cut in range(len(plan.fmt.opening(plan.function)), 0, -1):
        if ends is not None and cut not in ends:
            continue
        ids = encode(prompt + whole[:cut])
        if target[: len(ids)] == ids:
            return whole[:cut]
    return ""


# ----------------------------------------------------------------------------- reply


@dataclass
class Reply:
    """One choice's assistant message and finish reason; ``parsed``: the message is not the plain
    text (reasoning or tool calls were taken out of it)."""

    message: dict
    finish_reason: str
    parsed: bool
    dropped_calls: int = 0  # sampled calls left out of the message (``parallel_tool_calls: false``)


def _message(content: str | None, reasoning: str | None = None, calls: list | None = None) -> dict:
    msg = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
           "function_call": None, "reasoning": reasoning, "reasoning_content": reasoning}
    if calls:  # vLLM leaves an empty list out
        msg["tool_calls"] = calls
    return msg


def reply_message(plan: ToolPlan, text: str, finish_reason: str, opening: str = "", thinking: bool = True) -> Reply:
    """The assistant message of a choice whose sampled text is ``text`` (after ``opening``, the forced
    start of a call that was the end of the prompt). ``thinking``: the request's
    ``chat_template_kwargs.enable_thinking`` (vLLM parses no reasoning when it is false)."""
    fmt = plan.fmt
    if fmt is None:
        return Reply(_message(text), finish_reason, False)
    if plan.choice == NONE:  # vLLM: the reasoning parser only
        reasoning, rest = fmt.reasoning(text, thinking=thinking)
        return Reply(_message(rest, reasoning), finish_reason, reasoning is not None or rest != text)
    parsed = fmt.parse(opening + text, thinking=thinking)
    calls = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function", "function": dict(c["function"])}
             for c in parsed.get("tool_calls") or []]
    dropped = 0
    if not plan.parallel:
        calls, dropped = calls[:1], max(0, len(calls) - 1)
    finish = finish_reason
    if calls and plan.choice in (AUTO, REQUIRED) and finish_reason == "stop":
        finish = "tool_calls"
    reasoning = parsed.get("reasoning_content")
    msg = _message(parsed.get("content"), reasoning, calls)
    return Reply(msg, finish, bool(calls) or reasoning is not None or msg["content"] != text, dropped)


def stream_delta(message: dict) -> dict:
    """A parsed message as one stream delta (each tool call whole, with its index)."""
    delta = {k: message[k] for k in ("content", "reasoning", "reasoning_content") if message.get(k) is not None}
    calls = message.get("tool_calls") or []
    if calls:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
    return delta
