"""vLLM's OpenAI-compatible wire format: requests and logprob formatting (DESIGN.md s.7).

Shared by ``prodrl serve`` (which formats), the vLLM client and the recorder (which parse, with
``logprob_parsing``). The
field names and quirks follow vLLM's OpenAI server (``vllm/entrypoints/openai``, 2025-2026):

* ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids``: per choice for
  ``/v1/completions``; for ``/v1/chat/completions`` ``prompt_token_ids`` is top-level and
  ``token_ids`` per choice. When streaming, ``prompt_token_ids`` comes in the first chunk only and
  ``token_ids`` holds each chunk's delta.
* Per generated position vLLM keeps an ordered dict ``{sampled id: lp, top-1 id: lp, ..., top-N}``
  (the sampled token first; a sampled token that is also in the top-N appears once, at the front).
  Completions return, per position, the first ``N + 1`` entries of that dict as
  ``top_logprobs: {token string: logprob}``; chat returns the first ``N`` entries as
  ``logprobs.content[i].top_logprobs: [{token, logprob, bytes}]``. So a chat head can miss the N-th
  most likely token when the sampled token is not among the top N (``reconstruct_head``).
* Logprobs are clamped to ``-9999.0`` (JSON has no -inf): with ``--logprobs-mode
  processed_logprobs`` tokens outside the top-k/top-p support carry that value.
* Token strings are ``tokenizer.decode([id])``, or ``"token_id:<id>"`` with
  ``return_tokens_as_token_ids: true`` -- the only way to get exact ids of the top-N tokens, so the
  client and the recorder always ask for it.
* Errors are ``{"error": {"message", "type", "param", "code"}}``.

prodrl extension (not in vLLM), the extra draw of the ``score_centering_sampled`` correction:

* request field ``"extra_draw": true`` (a vLLM-style extra field; vLLM accepts and ignores unknown
  fields): ``prodrl serve`` also draws one independent token a' ~ mu per generated position (from the
  same processed distribution as the sampled token, never fed back) and returns it per choice as
  ``extra_token_ids`` (``EXTRA_IDS_FIELD``): the whole list when not streaming, each chunk's delta
  when streaming (aligned with ``token_ids``; same length as the choice's generated tokens). The
  field is absent when not asked for, and absent from a real vLLM's answer whatever was asked.
* The extra draw takes random numbers from the request's stream, so a seeded request asking for it
  samples other tokens than the same request without it (each is reproducible:
  ``LocalEngine.generate([p], SamplingParams(..., record_extra_draw=True), seed)``).
"""

from __future__ import annotations


import json
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "EXTRA_DRAW_FIELD",
    "EXTRA_IDS_FIELD",
    "ROUTED_EXPERTS_FIELD",
    "ROUTED_EXPERTS_START_FIELD",
    "LOGPROB_FLOOR",
    "TOKEN_ID_PREFIX",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ProtocolError",
    "error_body",
    "token_id_string",
    "position_entries",
    "completion_logprobs",
    "chat_logprobs",
    "sse",
    "SSE_DONE",
    "iter_sse_data",
]

# vLLM's JSON stand-in for -inf in logprobs (same value as engines.local.TOP_LOGPROB_FLOOR).
LOGPROB_FLOOR = -9999.0
TOKEN_ID_PREFIX = "token_id:"
# The prodrl extension asking for / returning the extra draw a' ~ mu (see the module docstring).
EXTRA_DRAW_FIELD = "extra_draw"
EXTRA_IDS_FIELD = "extra_token_ids"
# vLLM's MoE routing (``--enable-return-routed-experts``): per choice, base64 of a .npy
# [prompt + output - 1 - start, layers, k]; the request's ``routed_experts_prompt_start`` skips
# prompt positions (``trajectories.routing``)
ROUTED_EXPERTS_FIELD = "routed_experts"
ROUTED_EXPERTS_START_FIELD = "routed_experts_prompt_start"
# A head whose probabilities sum to at least 1 - this is taken to hold the whole support.
COMPLETE_MASS_TOL = 1e-6


class ProtocolError(ValueError):
    """A response or request that does not follow the wire format; ``status`` is the HTTP code to answer."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


# Requests are refused past this size (413) before they are parsed or tokenized: a 20 MB prompt
# otherwise holds a server's event loop for every client while it is read and tokenized.
MAX_BODY_BYTES = 8 << 20


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """A Starlette request's body, refused with a 413 ``ProtocolError`` past ``limit`` bytes: at once
    when its declared length is larger, else as soon as the received bytes pass it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"the request body is {int(declared)} bytes, at most {limit}", status=413)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise ProtocolError(f"the request body is over {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


_ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 413: "RequestTooLarge",
                422: "UnprocessableEntity", 429: "RateLimitError",
                500: "InternalServerError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout"}


def error_body(message: str, code: int = 400, param: str | None = None, type_: str | None = None) -> dict:
    """vLLM's error response body."""
    return {"error": {"message": message, "type": type_ or _ERROR_TYPES.get(code, "Error"),
                      "param": param, "code": code}}


# ----------------------------------------------------------------------------- requests


class _Base(BaseModel):
    # Like vLLM's OpenAIBaseModel: unknown fields are accepted (and ignored).
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Base):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Base):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = None
    extra_draw: bool | None = None  # prodrl extension: also return ``extra_token_ids`` (module docstring)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[int] | list[list[int]] | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class ChatMessage(_Base):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None
    response_format: dict[str, Any] | None = None


def message_content(content: str | list[dict[str, Any]] | None) -> str:
    """Text of a chat message content (vLLM's "string" content format: text parts joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ProtocolError(f"content part of type {part.get('type')!r} is not supported (text only)",
                                param="messages")
        parts.append(str(part.get("text", "")))
    return "\n".join(parts)


# ----------------------------------------------------------------------------- token strings


@lru_cache(maxsize=1 << 20)
def token_id_string(token_id: int) -> str:
    return f"{TOKEN_ID_PREFIX}{int(token_id)}"


def _clamp(lp: float) -> float:
    return max(float(lp), LOGPROB_FLOOR)


# ----------------------------------------------------------------------------- formatting (server side)


def position_entries(sampled_id: int, sampled_lp: float, head_ids: Sequence[int], head_lps: Sequence[float],
                     n: int) -> list[tuple[int, float]]:
    """vLLM's per-position logprob dict as an ordered list: the sampled token, then the top ``n``
    (a top token equal to the sampled one is not repeated)."""
    out = [(int(sampled_id), float(sampled_lp))]
    seen = {int(sampled_id)}
    for tid, lp in zip(list(head_ids)[: max(n, 0)], head_lps):
        tid = int(tid)
        if tid not in seen:
            seen.add(tid)
            out.append((tid, float(lp)))
    return out


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[Sequence[tuple[int, float]]],
    n: int,
    token_str: Callable[[int], str],
    initial_text_offset: int = 0,
) -> dict:
    """``choices[i].logprobs`` of ``/v1/completions`` (``CompletionLogProbs``), vLLM's layout:
    ``tokens``, ``token_logprobs``, ``top_logprobs`` (dicts of the first n + 1 entries of each
    position, sampled token first) and ``text_offset``."""
    floor = LOGPROB_FLOOR
    tokens = [token_str(int(t)) for t in token_ids]
    token_logprobs, tops = [], []
    for tid, entries in zip(token_ids, positions):
        tid = int(tid)
        lp = entries[0][1] if entries and entries[0][0] == tid else dict(entries).get(tid)
        token_logprobs.append(None if lp is None else (lp if lp > floor else floor))
        tops.append({token_str(e): (v if v > floor else floor) for e, v in entries[: max(n, 0) + 1]})
    offsets, at = [], initial_text_offset
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}


@lru_cache(maxsize=1 << 18)
def _utf8_cached(s: str) -> tuple[int, ...]:
    return tuple(s.encode("utf-8", errors="replace"))


def _utf8(s: str) -> list[int]:
    return list(_utf8_cached(s))  # token strings repeat (one vocabulary): encoded once each


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[Sequence[tuple[int, float]]],
    n: int,
    token_str: Callable[[int], str],
    decoded: Callable[[int], str],
) -> dict:
    """``choices[i].logprobs`` of ``/v1/chat/completions``: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}] (first n entries, sampled token first)}]}``.

    As in vLLM, the entry's ``bytes`` are the UTF-8 of the decoded token even when ``token`` is a
    ``token_id:`` string, while the top entries' ``bytes`` encode their ``token`` string.
    """
    content = []
    for tid, entries in zip(token_ids, positions):
        lp = dict(entries).get(int(tid))
        tops = []
        for i, (eid, elp) in enumerate(entries):
            if n == -1 or i < n:
                s = token_str(eid)
                tops.append({"token": s, "logprob": _clamp(elp), "bytes": _utf8(s)})
        content.append({"token": token_str(int(tid)), "logprob": LOGPROB_FLOOR if lp is None else _clamp(lp),
                        "bytes": _utf8(decoded(int(tid))), "top_logprobs": tops})
    return {"content": content}


# ----------------------------------------------------------------------------- server-sent events

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def iter_sse_data(lines: Iterable[str]):
    """Yield the ``data:`` payloads of an SSE stream (strings; ``"[DONE]"`` included), skipping
    comments and other fields."""
    buf: list[str] = []
    for line in lines:
        if line == "":
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue
        if line.startswith("data:"):
            data = line[5:]
            buf.append(data[1:] if data.startswith(" ") else data)
    if buf:
        yield "\n".join(buf)

