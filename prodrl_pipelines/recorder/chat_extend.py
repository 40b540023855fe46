"""``chat_history: extend``: a session's chat calls served as extensions of its previous call's tokens.

Real chat templates re-render history (Qwen3 drops earlier ``<think>`` blocks, Llama puts today's date
in the system header, others re-serialise tool calls), so the prompt of call k+1 is often not the
prompt + output of call k, and the trainer gets several sequences per episode. In this mode the
recorder renders the prompt itself, from the deployment's own chat template, and sends the upstream a
``/v1/completions`` request of token ids:

- the first call of a session (or one that does not extend the last): the whole conversation rendered
  (with the opening of a forced tool call, as the server would);
- a call whose messages are the previous call's messages, the assistant reply it got back, then new
  messages: previous prompt ids + previous output ids + the *bridge*, the template's text between an
  assistant message and the next generation prompt (rendered around a placeholder), less the end of
  turn the output already holds. The served prompt is then exactly the recorded prefix (the approach
  of prime-rl's turn bridge and SkyRL's token-in/token-out).

The answer is turned back into a chat answer (the reply parser splits reasoning and tool calls;
streamed calls get the whole answer as chunks; a Responses call, translated to chat as on the plain
path, gets a Response or its events). The trade-off: the model sees its own reasoning in history
where its template would have stripped it. Calls without a session, with ``n`` > 1, without a
tokenizer, or that the plain path would not record or would render otherwise (``extend_refusal``) take
the plain path (``extend_skipped.<reason>`` counters); ``chat_template_kwargs`` are rendered with.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

PLACEHOLDER = "\u2063prodrl-bridge\u2063"  # assistant content that no template or model writes
MAX_SESSIONS = 10_000


@dataclass
class Turn:
    messages: list[dict]  # the request's messages, normalised
    tools: str  # the tool definitions, as canonical JSON
    prompt_ids: list[int]
    output_ids: list[int]  # as sampled (the stop token included when the model stopped)
    stopped: bool  # the last output id is the stop token that ended the turn
    reply: dict  # the assistant message the client got
    # the reply left sampled tool calls out (``parallel_tool_calls: false``): its output ids hold calls
    # that never ran, so the next call is rendered from the messages, as the client sent them
    truncated: bool = False
    template: str = "{}"  # the chat_template_kwargs it was rendered with, as canonical JSON


@dataclass
class Plan:
    prompt_ids: list[int]
    opening: str  # the forced start of a tool call (prompt), "" for none
    messages: list[dict]
    tools: str
    extended: bool  # True: a bridge after the previous call; False: the whole conversation rendered
    template: str = "{}"  # the chat_template_kwargs rendered with, as canonical JSON
    thinking: bool = True  # chat_template_kwargs' enable_thinking, as vLLM's reasoning parser reads it


def _norm(messages: list[dict]) -> list[dict]:
    from prodrl_pipelines.engines.chat_tools import normalize_messages

    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    out = []
    for m in normalize_messages([dict(m) for m in messages]):
        c = m.get("content")
        if isinstance(c, list):  # content parts: the text of each
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
        out.append({k: (c if k == "content" else m.get(k)) for k in keep if m.get(k) is not None or k == "content"})
    return out


def _calls(msg: dict) -> list[tuple[str, str]]:
    out = []
    for c in msg.get("tool_calls") or []:
        f = c.get("function") or {}
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append((f.get("name"), json.dumps(args, sort_keys=True)))
    return out


def echoes(echo: dict, reply: dict) -> bool:
    """Whether the assistant message a client sent back is the reply it got (its calls, else its text)."""
    if echo.get("role") != "assistant":
        return False
    if reply.get("tool_calls"):
        return _calls(echo) == _calls(reply)
    return (echo.get("content") or "").strip() == (reply.get("content") or "").strip()


class ChatExtender:
    """The sessions' last turns and the rendering (the tokenizer with its chat template)."""

    def __init__(self, tokenizer_dir: str, reply_parser: str = "none") -> None:
        from transformers import AutoTokenizer

        from prodrl_pipelines.engines.reply_parsers import TOOL_FORMATS

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        if getattr(self.tok, "chat_template", None) is None:
            raise ValueError(f"chat_history 'extend': the tokenizer at {tokenizer_dir} has no chat template")
        self.fmt = TOOL_FORMATS.get(reply_parser) if reply_parser and reply_parser != "none" else None
        self.sessions: OrderedDict[str, list[Turn]] = OrderedDict()
        self.template_vars = _template_variables(self.tok.chat_template)
        try:  # a chat call's default length is what the model's context leaves (completions default to 16)
            cfg = json.loads((Path(tokenizer_dir) / "config.json").read_text())
            self.max_len = int(cfg.get("max_position_embeddings") or 0)
        except (OSError, ValueError, TypeError):
            self.max_len = 0

    def tool_plan(self, body: dict):
        from prodrl_pipelines.engines.chat_tools import plan_tools

        return plan_tools(body, self.fmt)

    def template_kwargs(self, body: dict) -> dict:
        """The request's ``chat_template_kwargs`` as vLLM 0.32 renders with them: those its template
        reads (the rest are dropped, as vLLM drops them; the keys that would change the rendering's own
        mechanics send the call down the plain path: ``extend_refusal``)."""
        kw = body.get("chat_template_kwargs") or {}
        return {k: v for k, v in kw.items() if self.template_vars is None or k in self.template_vars}

    def _render(self, messages: list[dict], tools, generation: bool, template_kwargs: dict | None = None) -> str:
        kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kw)

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def rendered_ids(self, body: dict, plan_tools_result) -> list[int]:
        """The whole conversation of ``body`` as the upstream renders it (what vLLM counts as its input
        tokens: no session, no forced opening)."""
        return self._ids(self._render(_norm(body.get("messages") or []), plan_tools_result.tools, True,
                                      self.template_kwargs(body)))

    def plan(self, tid: str, body: dict, plan_tools_result) -> tuple[Plan | None, str]:
        """The prompt of this call: (plan, "") extending the session's last turn (or its turn before,
        for a client's retry of the same call), else the whole conversation with the reason why."""
        from prodrl_pipelines.engines.chat_tools import forced_opening

        messages = _norm(body.get("messages") or [])
        tools_key = json.dumps(plan_tools_result.tools, sort_keys=True)
        kwargs = self.template_kwargs(body)
        template = json.dumps(kwargs, sort_keys=True)
        thinking = bool((body.get("chat_template_kwargs") or {}).get("enable_thinking", True))
        reason = "first_call"
        for turn in reversed(self.sessions.get(tid, [])):
            n = len(turn.messages)
            if turn.tools != tools_key:
                reason = "tools_changed"
                continue
            if turn.template != template:  # e.g. thinking switched off: the prefix was rendered otherwise
                reason = "template_kwargs_changed"
                continue
            if len(messages) <= n + 1 or messages[:n] != turn.messages:
                reason = "history_changed"
                continue
            if not echoes(messages[n], turn.reply):
                reason = "reply_not_echoed"
                continue
            if turn.truncated:
                reason = "reply_truncated"
                continue
            bridge = self._bridge(turn, messages[n + 1:], plan_tools_result, kwargs)
            if bridge is None:
                reason = "bridge_mismatch"
                continue
            text, opening = bridge
            return Plan(turn.prompt_ids + turn.output_ids + self._ids(text), opening, messages, tools_key, True,
                        template, thinking), ""
        text = self._render(messages, plan_tools_result.tools, True, kwargs)
        opening = forced_opening(plan_tools_result, self.tok, text)
        return Plan(self._ids(text + opening), opening, messages, tools_key, False, template, thinking), reason

    def _bridge(self, turn: Turn, new: list[dict], tools, template_kwargs: dict) -> tuple[str, str] | None:
        """The template's text from the end of the previous output to the next generation prompt."""
        from prodrl_pipelines.engines.chat_tools import forced_opening

        history = turn.messages + [{"role": "assistant", "content": PLACEHOLDER}]
        full = self._render(history + new, tools.tools, True, template_kwargs)
        at = full.rfind(PLACEHOLDER)
        if at < 0:
            return None
        text = full[at + len(PLACEHOLDER):]
        if turn.stopped:  # the output holds the end of its turn already
            eos = self.tok.decode([turn.output_ids[-1]], skip_special_tokens=False)
            if not text.startswith(eos):
                return None
            text = text[len(eos):]
        opening = forced_opening(tools, self.tok, full)
        return text + opening, opening

    def remember(self, tid: str, plan: Plan, output_ids: list[int], stopped: bool, reply: dict,
                 truncated: bool = False) -> None:
        turns = self.sessions.pop(tid, [])
        turn = Turn(plan.messages, plan.tools, plan.prompt_ids, output_ids, stopped, reply, truncated, plan.template)
        self.sessions[tid] = (turns + [turn])[-2:]  # the turn before: a client's retry of the last call
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    def output_text(self, ids: list[int], stopped: bool) -> str:
        return self.tok.decode(ids[:-1] if stopped and ids else ids, skip_special_tokens=False)


def completion_body(body: dict, plan: Plan, max_len: int = 0) -> dict:
    """The ``/v1/completions`` request of a chat request rendered to ``plan.prompt_ids``."""
    keep = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens")
    out = {k: body[k] for k in keep if body.get(k) is not None}
    out["prompt"] = plan.prompt_ids
    mt = body.get("max_completion_tokens") or body.get("max_tokens")
    if mt is None and max_len > len(plan.prompt_ids):
        mt = max_len - len(plan.prompt_ids)
    if mt is not None:
        out["max_tokens"] = mt
    out["skip_special_tokens"] = False
    return out


def chat_logprobs(lp: dict | None, n: int) -> dict | None:
    """Completion logprobs (tokens, token_logprobs, top_logprobs) as a chat answer's ``content`` list."""
    if lp is None:
        return None
    content = []
    for tok, val, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []):
        alts = sorted((top or {}).items(), key=lambda kv: -kv[1])[:n]
        content.append({"token": tok, "logprob": val, "bytes": None,
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": None} for t, v in alts]})
    return {"content": content}


def chat_answer(data: dict, message: dict, finish: str, logprobs: dict | None, usage: dict) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": data.get("model"), "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                                      "finish_reason": finish}], "usage": usage}


def chat_stream(answer: dict, include_usage: bool) -> bytes:
    """A whole chat answer as the chunks of a stream (role, then the message, then the finish)."""
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chat_chunks(answer, include_usage)) \
        + b"data: [DONE]\n\n"


def responses_stream(shape, answer: dict) -> bytes:
    """A whole chat answer as the event stream of the API its shape translates (``http.SHAPES``)."""
    usage = shape.usage(None, None, answer["usage"])
    events = [*shape.start_events()]
    for c in chat_chunks(answer, False):
        events += shape.chunk_events(c)
    return b"".join(events + [*shape.end_events(answer["choices"][0]["finish_reason"], usage)])


def chat_chunks(answer: dict, include_usage: bool) -> list[dict]:
    from prodrl_pipelines.engines.chat_tools import stream_delta

    base = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}
    choice = answer["choices"][0]
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": stream_delta(choice["message"]),
                                    "logprobs": choice["logprobs"], "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": choice["finish_reason"]}]}]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": answer["usage"]})
    return chunks


async def serve_extended(rec, ext: ChatExtender, body: dict, caller, pv: str | None, task_id: str | None, ask,
                         shape=None, request=None):
    """One chat call of a session through ``ext``: rendered here, sent as a completion of token ids,
    recorded, answered as chat (streamed as chunks when asked); ``shape``: a Responses call
    (``http.SHAPES``), answered in that API's form (or its events)."""
    import aiohttp
    from starlette.responses import Response

    from prodrl_pipelines.engines.chat_tools import reply_message
    from prodrl_pipelines.recorder.calls import UPSTREAM_SHAPE_ERRORS, dumps, err, upstream_error, upstream_unavailable
    from prodrl_pipelines.recorder.requests import Ask, Unrecordable

    stats, headers = rec.stats, {"X-Trajectory-Id": caller.client_tid}
    tools = ext.tool_plan(body)  # a ProtocolError: the 400 the server would give
    plan, why = ext.plan(caller.tid, body, tools)
    stats.inc("extend_bridged" if plan.extended else f"extend_rendered.{why}")
    up = rec.force(completion_body(body, plan, ext.max_len), "completion", Ask(False, None, False, False))
    try:
        status, ctype, content = await rec.read_upstream("v1/completions", up, caller.tid)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return upstream_unavailable(exc, stats, headers)
    if status != 200:
        return upstream_error(status, content, ctype, headers, stats)
    row, reason = None, None
    try:
        data = json.loads(content)
        choice = data["choices"][0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        finish = choice.get("finish_reason")
        stopped = finish == "stop" and not isinstance(choice.get("stop_reason"), str)
        text = ext.output_text(ids, stopped)
        try:
            row = rec.build_row("completion", data, up, pv, task_id)
            row["output_text"] = text  # the sampled text, <think> and <tool_call> blocks included
        except Unrecordable as u:
            reason = u.reason
        reply = reply_message(tools, text, finish or "stop", plan.opening, thinking=plan.thinking)
        logprobs = None
        if ask.n is not None:
            logprobs = chat_logprobs(choice.get("logprobs"), ask.n)
            if logprobs is not None and not ask.as_ids and rec.tokens is not None:
                for c in logprobs["content"]:
                    for t in [c, *c["top_logprobs"]]:
                        if str(t["token"]).startswith("token_id:"):
                            t["token"] = rec.tokens.piece(int(t["token"].split(":", 1)[1]))
        n_prompt = len(plan.prompt_ids)
        answer = chat_answer(data, reply.message, reply.finish_reason, logprobs,
                             {"prompt_tokens": n_prompt, "completion_tokens": len(ids),
                              "total_tokens": n_prompt + len(ids)})
    except (ValueError, *UPSTREAM_SHAPE_ERRORS) as exc:
        return err(f"the upstream server's answer is malformed ({type(exc).__name__}: {exc})", 502, stats,
                   "upstream_bad_answers", headers)
    if request is not None and await request.is_disconnected():  # its retry is the call, not this
        stats.count("client_disconnected", tenant=caller.tenant.name)
        return err("the client disconnected before the answer", 499, headers=headers)
    try:
        index = await rec.commit(caller.tid, row, reason, caller.attempt, caller.tenant.name)
    except Exception as exc:  # the WAL failed: the client must not believe the call was recorded
        return err(f"the call could not be recorded durably: {exc}", 503, stats, "commit_failures", headers)
    ext.remember(caller.tid, plan, ids, stopped, reply.message, truncated=reply.dropped_calls > 0)
    headers.update({"X-Call-Index": str(index), "X-Prodrl-Recorded": "true" if row is not None else "false"})
    if shape is not None and body.get("stream"):
        return Response(responses_stream(shape, answer), media_type="text/event-stream", headers=headers)
    if shape is not None:
        return Response(dumps(shape.answer(answer, shape.usage(None, None, answer["usage"]))),
                        media_type="application/json", headers=headers)
    if body.get("stream"):
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return Response(chat_stream(answer, usage), media_type="text/event-stream", headers=headers)
    return Response(dumps(answer), media_type="application/json", headers=headers)


# request fields that change how the prompt is rendered, which the extend path does not render with:
# such a call takes the plain path (the upstream renders it as asked)
RENDERING_FIELDS = ("chat_template", "reasoning_effort", "continue_final_message", "add_generation_prompt",
                    "documents", "mm_processor_kwargs")
# chat_template_kwargs the extend path renders with (Qwen3's enable_thinking, a template's own switches),
# except these, which would change how it renders (vLLM refuses the last two)
TEMPLATE_MECHANICS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "reasoning_effort", "return_dict",
                                "return_assistant_tokens_mask", "chat_template", "tokenize"})


def _template_variables(template) -> frozenset[str] | None:
    """The variables a chat template reads (what vLLM keeps of a request's chat_template_kwargs);
    None when it cannot be parsed here (then every kwarg is passed, as the template decides)."""
    import jinja2
    import jinja2.meta

    if not isinstance(template, str):
        return None
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None


def extend_refusal(body: dict) -> str | None:
    """Why a chat call cannot take the extend path (the counted reason), None when it can: a call the
    plain path would not record as trainable (greedy, a penalty, a constraint or a structured output,
    which the completion the extend path sends would drop) keeps the plain path's rules, and so does
    one that asks for its own rendering."""
    from prodrl_pipelines.recorder.requests import unrecordable_reason

    if (body.get("n") or 1) != 1:
        return "n"
    if unrecordable_reason(body, "chat") is not None:
        return "unrecordable"
    kw = body.get("chat_template_kwargs")
    if kw is not None and (not isinstance(kw, dict) or TEMPLATE_MECHANICS & kw.keys()):
        return "chat_template_kwargs"
    for name in RENDERING_FIELDS:
        if body.get("add_generation_prompt") is False if name == "add_generation_prompt" else body.get(name):
            return name
    return None


def extender_of(rec) -> ChatExtender | None:
    """The recorder's extender (made once its tokenizer is known), None while there is none."""
    ext = getattr(rec, "_chat_extender", None)
    if ext is None and rec.tokenizer_source:
        ext = rec._chat_extender = ChatExtender(rec.tokenizer_source, rec.cfg.reply_parser)
    return ext
