"""An OpenAI request turned into engine work (sampling params, prompts, stops) and the engine's records back into choices."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prodrl_pipelines.engines.openai_protocol import (
    ROUTED_EXPERTS_START_FIELD, ProtocolError, position_entries, token_id_string,
)
from prodrl_pipelines.engines.serve_state import ServeState
from prodrl_pipelines.engines.types import CallRecord, SamplingParams

GREEDY_EPS = 1e-5


# ----------------------------------------------------------------------------- request -> engine


@dataclass
class RequestPlan:
    """One request resolved: the prompts (ids, text), engine params and the formatting choices."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: SamplingParams
    seed: int | None
    n: int
    n_logprobs: int | None  # None: not requested
    extra_draw: bool  # return ``extra_token_ids`` (the prodrl extension)
    explicit_stops: frozenset[int]
    stop_strings: list[str]
    routing_start: int = 0  # ``routed_experts_prompt_start``: prompt positions left out of the routing
    model: str | None = None  # the LoRA adapter that serves it (None: the base)


_UNSUPPORTED_NONDEFAULT = {
    # field: the neutral value vLLM would use
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
}


def _check_supported(req, kind: str) -> None:
    for name, neutral in _UNSUPPORTED_NONDEFAULT.items():
        value = getattr(req, name, None)
        if value is not None and float(value) != neutral:
            raise ProtocolError(f"`{name}` is not supported by prodrl serve (only {neutral})", param=name)
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        if getattr(req, name, None):
            raise ProtocolError(f"`{name}` is not supported by prodrl serve", param=name)
    if req.use_beam_search:
        raise ProtocolError("beam search is not supported by prodrl serve", param="use_beam_search")
    if req.prompt_logprobs is not None:
        raise ProtocolError("`prompt_logprobs` is not supported by prodrl serve", param="prompt_logprobs")
    extra = req.model_extra or {}
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "logprob_token_ids", "prompt_embeds"):
        if extra.get(name):
            raise ProtocolError(f"`{name}` is not supported by prodrl serve", param=name)
    if kind == "completion":
        if req.echo:
            raise ProtocolError("`echo` is not supported by prodrl serve", param="echo")
        if req.suffix is not None:
            raise ProtocolError("suffix is not currently supported", param="suffix")
        if req.best_of not in (None, 1) and req.best_of != req.n:
            raise ProtocolError("`best_of` is not supported by prodrl serve", param="best_of")
    else:
        rf = req.response_format
        if rf and rf.get("type") not in (None, "text"):
            raise ProtocolError("`response_format` other than text is not supported by prodrl serve",
                                param="response_format")


def plan_request(state: ServeState, req, kind: str, prompts: list[list[int]],
                 prompt_texts: list[str | None]) -> RequestPlan:
    info = state.info
    _check_supported(req, kind)
    if req.n < 1:
        raise ProtocolError("n must be at least 1", param="n")
    d = info.defaults
    temperature = req.temperature if req.temperature is not None else float(d.get("temperature", 1.0))
    top_p = req.top_p if req.top_p is not None else float(d.get("top_p", 1.0))
    top_k = req.top_k if req.top_k is not None else int(d.get("top_k", 0))
    if temperature < 0:
        raise ProtocolError(f"temperature must be non-negative, got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise ProtocolError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if top_k == -1:
        top_k = 0
    if top_k < 0:
        raise ProtocolError(f"top_k must be 0 or -1 (disable), or at least 1, got {top_k}", param="top_k")
    if temperature < GREEDY_EPS:  # greedy: served as top-k 1
        temperature, top_k, top_p = 1.0, 1, 1.0

    # logprobs
    if kind == "completion":
        n_lp = req.logprobs
        param = "logprobs"
    else:
        if req.top_logprobs and req.top_logprobs > 0 and not req.logprobs:
            raise ProtocolError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        param = "top_logprobs"
    if n_lp is not None:
        if n_lp == -1:
            n_lp = info.vocab_size
        elif n_lp < 0:
            raise ProtocolError(f"`{param}` must be a positive value or -1.", param=param)
        if state.max_logprobs != -1 and n_lp > state.max_logprobs:
            raise ProtocolError(f"Requested sample logprobs of {n_lp}, which is greater than max allowed: "
                                f"{state.max_logprobs}", param=param)

    # lengths
    longest = max(len(p) for p in prompts)
    if kind == "completion":
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
    else:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = info.max_model_len - longest
    if max_tokens < 1:
        raise ProtocolError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if longest + max_tokens > info.max_model_len:
        raise ProtocolError(
            f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the messages, {max_tokens} in the completion). "
            f"Please reduce the length of the messages or completion.", param="max_tokens")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < info.vocab_size]
        if bad:
            raise ProtocolError(f"Token id {bad[0]} is out of vocabulary", param="prompt")

    explicit = frozenset(int(t) for t in (req.stop_token_ids or []))
    stops = set(explicit) | (set() if req.ignore_eos else set(info.eos_token_ids))
    stop_strings = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        params = SamplingParams(
            temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), max_tokens=int(max_tokens),
            num_top_logprobs=max(int(n_lp or 1), 1), stop_token_ids=tuple(sorted(stops)),
            record_extra_draw=bool(req.extra_draw), record_routing=state.return_routed_experts,
        )
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    start = (req.model_extra or {}).get(ROUTED_EXPERTS_START_FIELD) or 0
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ProtocolError(f"{ROUTED_EXPERTS_START_FIELD} must be an integer >= 0", param=ROUTED_EXPERTS_START_FIELD)
    shortest = min(len(p) for p in prompts)
    if start > shortest:
        raise ProtocolError(f"{ROUTED_EXPERTS_START_FIELD} must be between 0 and the prompt length ({shortest}), "
                            "inclusive.", param=ROUTED_EXPERTS_START_FIELD)
    adapter = req.model if req.model is not None and req.model in state.batcher.adapters else None
    return RequestPlan(prompts, prompt_texts, params, req.seed, req.n, n_lp, bool(req.extra_draw), explicit,
                       stop_strings, start, adapter)


async def run_plan(state: ServeState, plan: RequestPlan) -> list[list[CallRecord]]:
    """Records per prompt (``n`` each), in order."""
    b = state.batcher
    if plan.seed is None:
        flat = [p for p in plan.prompts for _ in range(plan.n)]
        recs = await b.generate(flat, plan.params, None, plan.model)
        out = [recs[i * plan.n : (i + 1) * plan.n] for i in range(len(plan.prompts))]
    else:
        # Seeded: each prompt on its own with the request's seed (vLLM: seeded outputs do not depend
        # on the other requests in the batch).
        out = list(await asyncio.gather(*(b.generate([p] * plan.n, plan.params, plan.seed, plan.model) for p in plan.prompts)))
    state.metrics.first_token()  # the whole completion is there: a stream's first chunk can go out
    return out


@dataclass
class Choice:
    token_ids: list[int]
    logprobs: list[float]
    heads_ids: list[list[int]]
    heads_lps: list[list[float]]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    extra_ids: list[int] | None = None  # the extra draw, one per generated token (when asked)
    routed_experts: str | None = None  # vLLM's base64 .npy of the kept positions' experts (when served)


def finish_choice(state: ServeState, plan: RequestPlan, rec: CallRecord, skip_special: bool,
                  include_stop_str: bool) -> Choice:
    ids = list(rec.output_token_ids)
    lps = list(rec.output_logprobs)
    hid, hlp = list(rec.top_token_ids), list(rec.top_logprobs)
    extra = [int(t) for t in rec.extra_token_ids] if plan.extra_draw and rec.extra_token_ids is not None else None
    if plan.extra_draw and (extra is None or len(extra) != len(ids)):
        raise RuntimeError("the engine did not return one extra draw per generated token")
    finish = rec.finish_reason
    stop_reason: int | str | None = None
    stopped_by_token = finish == "stop" and ids and ids[-1] in plan.params.stop_token_ids
    text_ids = ids[:-1] if stopped_by_token else ids
    text = state.tokens.text(text_ids, skip_special)
    if plan.stop_strings:  # first prefix whose text holds a stop string
        for i in range(len(text_ids)):
            t = state.tokens.text(text_ids[: i + 1], skip_special)
            hits = [(t.find(s), s) for s in plan.stop_strings if s and s in t]
            if hits:
                at, s = min(hits)
                ids, lps, hid, hlp = ids[: i + 1], lps[: i + 1], hid[: i + 1], hlp[: i + 1]
                text = t[: at + len(s)] if include_stop_str else t[:at]
                return Choice(ids, lps, hid, hlp, text, "stop", s, None if extra is None else extra[: i + 1],
                              _routing(rec, plan, i + 1))
    if stopped_by_token:
        stop_reason = ids[-1] if ids[-1] in plan.explicit_stops else None
    return Choice(ids, lps, hid, hlp, text, finish, stop_reason, extra, _routing(rec, plan, len(ids)))


def _routing(rec: CallRecord, plan: RequestPlan, n_out: int) -> str | None:
    """vLLM's ``routed_experts`` of a choice that kept ``n_out`` output tokens: the forwarded
    positions from ``routing_start`` up to the last kept token (which is never forwarded itself)."""
    from prodrl_pipelines.trajectories.routing import to_vllm

    if rec.routed_experts is None:
        return None
    return to_vllm(rec.routed_experts[plan.routing_start:len(rec.prompt_token_ids) + n_out - 1])


def choice_positions(plan: RequestPlan, c: Choice, upto: slice = slice(None)) -> list[list[tuple[int, float]]]:
    n = plan.n_logprobs or 0
    return [position_entries(t, lp, hi, hl, n)
            for t, lp, hi, hl in zip(c.token_ids[upto], c.logprobs[upto], c.heads_ids[upto], c.heads_lps[upto])]


def token_formatter(state: ServeState, as_ids: bool):
    return token_id_string if as_ids else state.tokens.piece


def usage_block(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def text_deltas(state: ServeState, c: Choice, skip_special: bool) -> list[str]:
    """Per-token text deltas whose concatenation is the choice's text."""
    out, emitted = [], 0
    for i in range(len(c.token_ids)):
        t = state.tokens.text(c.token_ids[: i + 1], skip_special)
        end = len(t) if c.text.startswith(t) else emitted  # hold back text that is not final yet
        end = min(max(end, emitted), len(c.text))
        out.append(c.text[emitted:end])
        emitted = end
    if out:
        out[-1] += c.text[emitted:]
    return out
