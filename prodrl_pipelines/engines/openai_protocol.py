"""vLLM's OpenAI-compatible wire format: requests, logprob formatting and parsing (DESIGN.md s.7).

Shared by ``prodrl serve`` (which formats), the vLLM client and the recorder (which parse). The
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
import math
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
    "parse_token_id",
    "position_entries",
    "completion_logprobs",
    "chat_logprobs",
    "parse_completion_logprobs",
    "parse_chat_logprobs",
    "reconstruct_head",
    "narrow_entries",
    "head_support_complete",
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


_TOKEN_IDS: dict[str, int] = {}  # "token_id:<id>" -> id, filled as met (bounded by the vocabulary)
_TOKEN_IDS_MAX = 1 << 20


@lru_cache(maxsize=1 << 20)
def token_id_string(token_id: int) -> str:
    return f"{TOKEN_ID_PREFIX}{int(token_id)}"


def parse_token_id(token: str) -> int:
    """The id in a ``"token_id:<id>"`` string; ``ProtocolError`` for anything else."""
    tid = _TOKEN_IDS.get(token) if type(token) is str else None
    if tid is not None:
        return tid
    if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
        raise ProtocolError(f"expected a {TOKEN_ID_PREFIX!r} token string (return_tokens_as_token_ids), got {token!r}",
                            status=502)
    try:
        return int(token[len(TOKEN_ID_PREFIX):])
    except ValueError:
        raise ProtocolError(f"malformed token id string {token!r}", status=502) from None


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


# ----------------------------------------------------------------------------- parsing (client / recorder)


def reconstruct_head(
    sampled_id: int,
    sampled_lp: float,
    rest: Sequence[tuple[int, float]],
    k: int,
    n_requested: int | None = None,
) -> tuple[list[int], list[float]]:
    """The top-``k`` head (ids, logprobs, descending) of one position from vLLM's entry list.

    ``rest`` is the position's entries after the sampled token, in vLLM's order (the top tokens by
    rank, without the sampled one). For completions, ``n_requested`` (the ``logprobs`` asked for)
    tells whether the sampled token was in the top n: then ``rest`` has n - 1 entries and the
    sampled token goes back to its rank, found by its logprob (after any exactly equal logprobs;
    only the order among exact ties can differ from the engine's). Chat truncates the list at n, so
    its head is exact for k <= n - 1 only (``parse_chat_logprobs``).
    """
    sid = int(sampled_id)
    ids = [int(t) for t, _ in rest]
    lps = [float(lp) for _, lp in rest]
    return _head(sid, float(sampled_lp), ids, lps, k, n_requested)


def _head(sid: int, slp: float, ids: list[int], lps: list[float], k: int,
          n_requested: int | None) -> tuple[list[int], list[float]]:
    if sid in ids:  # not vLLM's layout (the sampled token repeated): drop the repeat
        keep = [i for i, t in enumerate(ids) if t != sid]
        ids, lps = [ids[i] for i in keep], [lps[i] for i in keep]
    if n_requested is None or len(ids) < n_requested:
        pos = sum(1 for lp in lps if lp >= slp)
        ids = ids[:pos] + [sid] + ids[pos:]
        lps = lps[:pos] + [slp] + lps[pos:]
    if len(ids) < k:
        raise ProtocolError(f"logprob head has {len(ids)} entries, fewer than the {k} requested", status=502)
    return ids[:k], lps[:k]


def narrow_entries(entries: Sequence[tuple[Any, float]], n_from: int | None, n_to: int) -> list[tuple[Any, float]]:
    """vLLM's per-position entries for ``logprobs = n_to`` from those returned for ``n_from >= n_to``.

    ``entries`` is the position's list in vLLM's order (sampled token first; keys compared by
    equality, e.g. ``token_id:`` strings). ``n_from`` is the completions request's n (its dict then
    tells whether the sampled token was in the top n); ``None`` for a chat list (cut at n entries).
    The result is ``[sampled] + (top n_to without the sampled token)``: a completions dict for
    n_to is all of it, a chat list its first n_to entries.
    """
    if not entries:
        return list(entries)
    s, rest = entries[0], [e for e in entries[1:] if e[0] != entries[0][0]]
    if n_from is not None and len(rest) >= n_from:
        ranked = rest
    else:
        pos = sum(1 for _, lp in rest if lp >= s[1])
        ranked = rest[:pos] + [s] + rest[pos:]
    return [s] + [e for e in ranked[: max(n_to, 0)] if e[0] != s[0]]


def _ids_of(keys) -> list[int]:
    """Ids of ``token_id:<id>`` strings; ``ProtocolError`` if any key is something else.

    A dict lookup per key (the strings repeat: one vocabulary) instead of parsing each: this was
    the recorder's largest own cost per call (20 top logprobs x every generated position)."""
    cache = _TOKEN_IDS
    try:
        return [cache[key] for key in keys]
    except (KeyError, TypeError):
        pass
    p, n = TOKEN_ID_PREFIX, len(TOKEN_ID_PREFIX)
    try:
        ids = [int(key[n:]) if key.startswith(p) else None for key in keys]
    except (ValueError, AttributeError):
        ids = [None]
    if None in ids:
        bad = next((key for key in keys if not (isinstance(key, str) and key.startswith(p))), keys)
        raise ProtocolError(f"expected {p!r} token strings (return_tokens_as_token_ids), got {bad!r}", status=502)
    if len(cache) > _TOKEN_IDS_MAX:
        cache.clear()
    for key, tid in zip(keys, ids):
        if key == token_id_string(tid):  # canonical spelling only ("token_id:007" is parsed, not cached)
            cache[key] = tid
    return ids


def parse_completion_logprobs(
    logprobs: dict | None, token_ids: Sequence[int], n_requested: int, k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """(sampled logprobs, head ids, head logprobs) from a completions ``logprobs`` object that was
    requested with ``logprobs=n_requested`` and ``return_tokens_as_token_ids``; heads of size k <= n."""
    if not isinstance(logprobs, dict):
        raise ProtocolError("the upstream answer has no logprobs", status=502)
    tops = logprobs.get("top_logprobs")
    lps = logprobs.get("token_logprobs")
    if not isinstance(tops, list) or not isinstance(lps, list) or len(tops) != len(token_ids) or len(lps) != len(token_ids):
        raise ProtocolError(f"logprobs cover {len(tops) if isinstance(tops, list) else 'no'} positions for "
                            f"{len(token_ids)} generated tokens", status=502)
    sampled, head_ids, head_lps = [], [], []
    for tid, lp, top in zip(token_ids, lps, tops):
        if lp is None or not isinstance(top, dict):
            raise ProtocolError("a generated position has no logprobs", status=502)
        ids = _ids_of(top)
        vals = list(map(float, top.values()))
        tid, lp = int(tid), float(lp)
        if ids and ids[0] == tid:
            ids, vals = ids[1:], vals[1:]
        else:  # not vLLM's order; treat the entries as a ranked list
            order = sorted((i for i, t in enumerate(ids) if t != tid), key=lambda i: -vals[i])
            ids, vals = [ids[i] for i in order], [vals[i] for i in order]
        hi, hl = _head(tid, lp, ids, vals, k, n_requested)
        sampled.append(lp)
        head_ids.append(hi)
        head_lps.append(hl)
    return sampled, head_ids, head_lps


def parse_chat_logprobs(
    logprobs: dict | None, token_ids: Sequence[int], k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Like ``parse_completion_logprobs`` for a chat ``logprobs.content`` list. The list holds the
    first n entries of vLLM's dict (sampled first), so asking ``top_logprobs = k + 1`` gives an
    exact top-k head."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(token_ids):
        raise ProtocolError(f"chat logprobs cover {len(content) if isinstance(content, list) else 'no'} positions "
                            f"for {len(token_ids)} generated tokens", status=502)
    sampled, head_ids, head_lps = [], [], []
    cache = _TOKEN_IDS
    for tid, item in zip(token_ids, content):
        if not isinstance(item, dict) or item.get("logprob") is None:
            raise ProtocolError("a generated position has no logprob", status=502)
        lp = float(item["logprob"])
        tops = item.get("top_logprobs") or []
        try:  # the token strings repeat (one vocabulary): a dict lookup each, as in ``_ids_of``
            ids = [cache[e["token"]] for e in tops]
        except (KeyError, TypeError):  # one not met yet, or not a token string: parsed entry by entry
            ids = [t for t, _ in _chat_entries(tops)]
        vals = [float(e["logprob"]) for e in tops]
        tid = int(tid)
        if ids and ids[0] == tid:
            ids, vals = ids[1:], vals[1:]
        else:
            rest = sorted(((t, v) for t, v in zip(ids, vals) if t != tid), key=lambda e: -e[1])
            ids, vals = [t for t, _ in rest], [v for _, v in rest]
        ids, vals = _head(tid, lp, ids, vals, k, None)
        sampled.append(lp)
        head_ids.append(ids)
        head_lps.append(vals)
    return sampled, head_ids, head_lps


def _chat_entries(tops: list) -> list[tuple[int, float]]:
    """(id, logprob) of a chat position's top entries, checked entry by entry (the first bad one
    raises); the canonical ``token_id:<id>`` strings are remembered for ``parse_chat_logprobs``."""
    entries = [(parse_token_id(e["token"]), float(e["logprob"])) for e in tops]
    if len(_TOKEN_IDS) > _TOKEN_IDS_MAX:
        _TOKEN_IDS.clear()
    for e, (t, _) in zip(tops, entries):
        if e["token"] == token_id_string(t):
            _TOKEN_IDS[e["token"]] = t
    return entries


def head_support_complete(top_k: int, k: int, head_lps: Iterable[Sequence[float]]) -> bool:
    """Whether the recorded heads hold the whole sampling support at every position.

    True when top-k sampling is on with ``top_k <= k`` (vLLM keeps exactly the top_k tokens; only
    exact logit ties at the threshold could add more), otherwise position by position: the head
    holds a floored (-9999, i.e. -inf) entry, so the support is smaller than the head, or the head's
    probabilities sum to at least ``1 - 1e-6`` (a tail below that is taken as empty). The local
    engine decides from the full distribution (support size <= k); the two agree except for such
    ties and tails.
    """
    if 0 < int(top_k) <= int(k):
        return True
    for row in head_lps:
        if any(v <= LOGPROB_FLOOR for v in row):
            continue
        if sum(math.exp(v) for v in row) >= 1.0 - COMPLETE_MASS_TOL:
            continue
        return False
    return True


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

