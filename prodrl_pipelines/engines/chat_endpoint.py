"""``POST /v1/chat/completions`` of ``prodrl serve``: messages (and tools) rendered with the model's chat
template, the reply turned into the assistant message (``chat_tools``), whole or streamed.

Streaming: a plain reply streams one token per chunk. A parsed reply (reasoning or tool calls taken
out of the text by the server's reply parser) streams its tokens in chunks with empty deltas and the
parsed parts whole in the last token's chunk (``delta.content``, ``delta.reasoning``, and
``delta.tool_calls`` with each call's index, id, type, name and arguments), so the accumulated
message is the non-streamed one. Every chunk keeps its token ids, logprobs and extra draws.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from prodrl_pipelines.engines.chat_tools import (
    ToolPlan, forced_opening, normalize_messages, plan_tools, reply_message, stream_delta,
)
from prodrl_pipelines.engines.openai_protocol import (
    EXTRA_IDS_FIELD, ROUTED_EXPERTS_FIELD, SSE_DONE, ChatCompletionRequest, ProtocolError, chat_logprobs, sse,
)
from prodrl_pipelines.engines.serve_http import check_model, error_response, json_body, tokenize, validate, whole_stream
from prodrl_pipelines.engines.serve_plan import (
    choice_positions, finish_choice, plan_request, run_plan, text_deltas, token_formatter, usage_block,
)
from prodrl_pipelines.engines.serve_state import ServeState

__all__ = ["chat_completions", "render_chat"]


def render_chat(state: ServeState, req: ChatCompletionRequest, tools: ToolPlan) -> tuple[str, list[int], str]:
    """(prompt text, prompt ids, forced opening): the template's text, with the opening of a call
    appended when the tool choice is forced (``chat_tools.forced_opening``)."""
    tok = state.engine.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise ProtocolError("the tokenizer has no chat template")
    messages = normalize_messages([m.model_dump() for m in req.messages])
    if req.continue_final_message and req.add_generation_prompt:
        raise ProtocolError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    kw = dict(req.chat_template_kwargs or {})
    if tools.tools is not None:
        kw["tools"] = tools.tools
    try:
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, **kw)
    except Exception as exc:  # template errors are the client's
        raise ProtocolError(f"chat template error: {exc}") from None
    opening = forced_opening(tools, tok, text, req.add_special_tokens)
    text += opening
    return text, tokenize(state, text, req.add_special_tokens), opening


async def chat_completions(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    try:
        req = validate(ChatCompletionRequest, await json_body(request))
        check_model(state, req.model)
        tools = plan_tools(req.model_extra or {}, state.tool_format)
        text, ids, opening = await asyncio.to_thread(render_chat, state, req, tools)
        if not ids:
            raise ProtocolError("the rendered chat prompt is empty", param="messages")
        plan = plan_request(state, req, "chat", [ids], [text])
        results = await run_plan(state, plan)
    except ProtocolError as exc:
        return error_response(exc)
    except ValueError as exc:
        return error_response(str(exc), 400)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    tstr = token_formatter(state, bool(req.return_tokens_as_token_ids))
    choices = [finish_choice(state, plan, r, req.skip_special_tokens, req.include_stop_str_in_output)
               for r in results[0]]
    thinking = bool((req.chat_template_kwargs or {}).get("enable_thinking", True))  # as vLLM's qwen3 parser reads it
    replies = [reply_message(tools, c.text, c.finish_reason, opening, thinking) for c in choices]
    model = plan.model or state.info.name
    if req.stream:
        return StreamingResponse(whole_stream(_chat_stream(state, req, plan, choices, replies, rid, created, model,
                                                           tstr, text)), media_type="text/event-stream")
    out = []
    for i, (c, reply) in enumerate(zip(choices, replies)):
        lp = None
        if plan.n_logprobs is not None:
            lp = chat_logprobs(c.token_ids, choice_positions(plan, c), plan.n_logprobs, tstr, state.tokens.piece)
        item = {"index": i, "message": reply.message, "logprobs": lp, "finish_reason": reply.finish_reason,
                "stop_reason": c.stop_reason, "token_ids": c.token_ids if req.return_token_ids else None}
        if plan.extra_draw:
            item[EXTRA_IDS_FIELD] = c.extra_ids
        if state.return_routed_experts:
            item[ROUTED_EXPERTS_FIELD] = c.routed_experts
        out.append(item)
    n_gen = sum(len(c.token_ids) for c in choices)
    body = {
        "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
        "service_tier": None, "system_fingerprint": None, "usage": usage_block(len(ids), n_gen),
        "prompt_logprobs": None, "prompt_token_ids": ids if req.return_token_ids else None,
        "kv_transfer_params": None,
    }
    body["prompt_text"] = text if req.return_prompt_text else None
    return JSONResponse(body)


def _chat_stream(state, req, plan, choices, replies, rid, created, model, tstr, prompt_text):
    ids = plan.prompts[0]

    def chunk(choice: dict, **top) -> bytes:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice], "usage": None, "prompt_token_ids": None, "prompt_text": None, **top})

    first = True
    for i, (c, reply) in enumerate(zip(choices, replies)):
        extra = {}
        if first and req.return_token_ids:  # vLLM: in the first chunk only
            extra["prompt_token_ids"] = ids
        if first and req.return_prompt_text:
            extra["prompt_text"] = prompt_text
        first = False
        yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}, **extra)
        deltas = None if reply.parsed else text_deltas(state, c, req.skip_special_tokens)
        for t in range(len(c.token_ids)):
            last = t == len(c.token_ids) - 1
            lp = None
            if plan.n_logprobs is not None:
                lp = chat_logprobs(c.token_ids[t : t + 1], choice_positions(plan, c, slice(t, t + 1)), plan.n_logprobs,
                                   tstr, state.tokens.piece)
            if deltas is not None:
                delta = {"content": deltas[t]}
            else:  # a parsed reply: its parts whole with the last token
                delta = stream_delta(reply.message) if last else {}
            item = {"index": i, "delta": delta, "logprobs": lp,
                    "finish_reason": reply.finish_reason if last else None,
                    "stop_reason": c.stop_reason if last else None,
                    "token_ids": c.token_ids[t : t + 1] if req.return_token_ids else None}
            if plan.extra_draw:
                item[EXTRA_IDS_FIELD] = c.extra_ids[t : t + 1]
            yield chunk(item)
    if req.stream_options is not None and req.stream_options.include_usage:
        n_gen = sum(len(c.token_ids) for c in choices)
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage_block(len(ids), n_gen)})
    yield SSE_DONE
