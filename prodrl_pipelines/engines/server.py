"""``prodrl serve``: the local engine behind vLLM's OpenAI-compatible HTTP API (DESIGN.md s.7).

Routes: ``POST /v1/completions`` (prompt as text, token ids, or a list of either),
``POST /v1/chat/completions`` (messages rendered with the tokenizer's chat template), both streaming
(SSE) and not; ``GET /v1/models``; ``GET /health``; ``POST /v1/load_model {"model_dir": ...}`` to
redeploy a new checkpoint in place. Responses carry vLLM's fields (``prompt_token_ids`` /
``token_ids`` with ``return_token_ids``, vLLM's ``logprobs`` layouts, see ``openai_protocol``), and
logprobs are processed logprobs, as from ``vllm serve --logprobs-mode processed_logprobs``.
Asking for more than ``--max-logprobs`` logprobs is a 400, as in vLLM.

Extension: ``"extra_draw": true`` in a completion or chat request adds, per choice,
``extra_token_ids``: one extra independent draw a' ~ mu per generated position (the local engine's
``record_extra_draw``, for the ``score_centering_sampled`` correction; see ``openai_protocol``).

Batching: requests are queued; a loop collects them (until 1 ms passes with no new request, or
``--batch-wait-ms`` in all) and calls ``engine.generate`` once per group of equal sampling parameters (one engine thread, so reloads and
batches never overlap). A request with a ``seed`` is generated on its own (each of its prompts
separately): vLLM makes a seeded request's output independent of the other traffic, while the local
engine draws one random stream per batch. So ``generate([p], params, seed)`` on the local engine
reproduces a seeded single-prompt request exactly.

Known differences from vLLM (documented, deliberate or not yet needed):

* Streaming is simulated: the whole completion is generated, then sent one token per chunk.
* Not supported (400): penalties, ``min_p``, ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
  beam search, ``best_of``, ``echo``, ``suffix``, ``prompt_logprobs``, structured outputs, tools and
  non-text message parts. ``temperature < 1e-5`` (vLLM: greedy) is served as top-k 1 at
  temperature 1, so its processed logprobs are 0 for the argmax.
* Stop strings are applied after generation (same tokens and text as vLLM's incremental check).
* Sampling defaults (temperature/top_p/top_k) come from ``generation_config.json`` when present, as
  vLLM's default ``--generation-config auto``; ``--generation-config vllm`` ignores them.
* Token strings in logprobs are ``tokenizer.decode([id])``; vLLM additionally restores SentencePiece
  leading spaces. Text is decoded in one piece per prefix rather than by vLLM's incremental
  detokenizer.
* Reload: vLLM has no such endpoint; redeploy it by restart (``vllm_client.vllm_serve_command``), or
  with its dev-mode ``/sleep`` / ``/wake_up`` plus a weight update through ``/collective_rpc``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prodrl_pipelines.engines.openai_protocol import (
    EXTRA_IDS_FIELD,
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    chat_logprobs,
    completion_logprobs,
    error_body,
    message_content,
    position_entries,
    sse,
    token_id_string,
)
from prodrl_pipelines.engines.types import CallRecord, SamplingParams

__all__ = ["EngineBatcher", "build_app", "BackgroundServer", "add_serve_parser", "cmd_serve", "KEEP_ALIVE_S"]

GREEDY_EPS = 1e-5
# How long an idle keep-alive connection is kept open (uvicorn's default is 5 s). It must exceed how
# long clients keep idle connections for reuse (httpx 5 s, aiohttp 15 s): with equal timeouts a
# client reuses a connection just as the server closes it, and the request is lost ("Server
# disconnected" / "Connection reset by peer"; uvloop even runs an expired timer before reading a
# request already in the socket). Measured at 128-256 concurrent clients on 2 shared cores: a
# client -> server connection sat idle ~5 s hundreds of times per minute.
KEEP_ALIVE_S = 120


# ----------------------------------------------------------------------------- batching


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    seed: int | None
    future: asyncio.Future


@dataclass
class BatcherStats:
    requests: int = 0
    generate_calls: int = 0
    prompts: int = 0


class EngineBatcher:
    """Collects concurrent generation requests and runs them through one engine thread.

    ``engine`` is anything with ``generate(prompts, params, seed) -> list[CallRecord]``. After the
    first request of a batch the loop keeps collecting until ``quiet_gap_ms`` pass without a new
    request, ``batch_wait_ms`` in all, or ``max_batch_size`` prompts; unseeded jobs with equal
    ``SamplingParams`` then share one ``generate`` call, a seeded job always runs alone. Requests
    that arrive while the engine is busy are all taken by the next batch.
    """

    def __init__(self, engine, batch_wait_ms: float = 10.0, max_batch_size: int = 64, quiet_gap_ms: float = 1.0) -> None:
        self.engine = engine
        self.batch_wait_s = max(float(batch_wait_ms), 0.0) / 1000.0
        self.quiet_gap_s = max(float(quiet_gap_ms), 0.0) / 1000.0
        self.max_batch_size = max(int(max_batch_size), 1)
        self.stats = BatcherStats()
        self._executor: ThreadPoolExecutor | None = None
        self._queue: asyncio.Queue[_Job] | None = None
        self._task: asyncio.Task | None = None

    @property
    def pending(self) -> int:
        """Jobs queued and not yet taken by the batching loop."""
        return 0 if self._queue is None else self._queue.qsize()

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prodrl-engine")
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._queue = None

    async def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> list[CallRecord]:
        if self._queue is None:
            raise RuntimeError("EngineBatcher.start() was not called")
        fut = asyncio.get_running_loop().create_future()
        self.stats.requests += 1
        await self._queue.put(_Job(prompts, params, seed, fut))
        return await fut

    async def call(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread (after any batch in progress)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _loop(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            jobs = [first]
            size = len(first.prompts)

            def drain() -> int:
                nonlocal size
                got = 0
                while size < self.max_batch_size:
                    try:
                        job = self._queue.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    jobs.append(job)
                    size += len(job.prompts)
                    got += 1
                return got

            drain()
            if self.batch_wait_s > 0 and first.seed is None:
                # Keep collecting while requests keep coming: stop after a quiet gap with no new
                # request, a full batch, or batch_wait in all.
                deadline = loop.time() + self.batch_wait_s
                while size < self.max_batch_size and loop.time() < deadline:
                    await asyncio.sleep(min(self.quiet_gap_s, max(deadline - loop.time(), 0.0)))
                    if drain() == 0:
                        break
            groups: dict[Any, list[_Job]] = {}
            for job in jobs:
                key = ("params", job.params) if job.seed is None else ("seeded", id(job))
                groups.setdefault(key, []).append(job)
            for group in groups.values():
                prompts = [p for j in group for p in j.prompts]
                params, seed = group[0].params, group[0].seed
                self.stats.generate_calls += 1
                self.stats.prompts += len(prompts)
                try:
                    records = await loop.run_in_executor(self._executor, self._generate, prompts, params, seed)
                except Exception as exc:  # the group's requests fail; the loop keeps serving
                    for j in group:
                        if not j.future.done():
                            j.future.set_exception(exc)
                    continue
                at = 0
                for j in group:
                    if not j.future.done():
                        j.future.set_result(records[at : at + len(j.prompts)])
                    at += len(j.prompts)

    def _generate(self, prompts, params, seed):
        return self.engine.generate(prompts, params, seed=seed)


# ----------------------------------------------------------------------------- model state


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class ModelInfo:
    """What the server needs to know about the loaded checkpoint besides the engine."""

    name: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    defaults: dict[str, float]  # sampling defaults from generation_config.json (may be empty)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, engine, model_dir: str | None, name: str, generation_config: str = "auto") -> ModelInfo:
        cfg = getattr(getattr(engine, "model", None), "config", None)
        max_len = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 30
        vocab = int(getattr(engine, "vocab_size", 0) or getattr(cfg, "vocab_size", 0) or 0)
        eos: set[int] = set()
        gen = _read_json(Path(model_dir) / "generation_config.json") if model_dir else {}
        for source in (gen.get("eos_token_id"), getattr(getattr(engine, "tokenizer", None), "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, list):
                eos.update(int(x) for x in source)
        defaults = {}
        if generation_config == "auto":
            defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}
        return cls(name, str(model_dir or ""), max_len, vocab, frozenset(eos), defaults)


class _Tokens:
    """Cached per-token strings (vLLM: ``tokenizer.decode([id])``) and text decoding."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._cache: dict[int, str] = {}

    def piece(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self.tok.decode([tid]) if self.tok is not None else ""
            self._cache[tid] = s
        return s

    def text(self, ids: Sequence[int], skip_special: bool) -> str:
        if self.tok is None or not ids:
            return ""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)


def load_engine(model_dir: str | os.PathLike, device: str = "cpu"):
    from prodrl_pipelines.engines.local import LocalEngine

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
    return LocalEngine.from_pretrained(path, device=device)


class ServeState:
    def __init__(self, engine, info: ModelInfo, *, max_logprobs: int, api_key: str | None,
                 batch_wait_ms: float, max_batch_size: int, generation_config: str, device: str,
                 batch_quiet_ms: float = 1.0) -> None:
        self.batcher = EngineBatcher(engine, batch_wait_ms, max_batch_size, batch_quiet_ms)
        self.info = info
        self.tokens = _Tokens(getattr(engine, "tokenizer", None))
        self.max_logprobs = int(max_logprobs)
        self.api_key = api_key
        self.generation_config = generation_config
        self.device = device

    @property
    def engine(self):
        return self.batcher.engine


# ----------------------------------------------------------------------------- request -> engine


@dataclass
class _Plan:
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
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools",
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


def _plan(state: ServeState, req, kind: str, prompts: list[list[int]], prompt_texts: list[str | None]) -> _Plan:
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
            record_extra_draw=bool(req.extra_draw),
        )
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    return _Plan(prompts, prompt_texts, params, req.seed, req.n, n_lp, bool(req.extra_draw), explicit, stop_strings)


async def _run(state: ServeState, plan: _Plan) -> list[list[CallRecord]]:
    """Records per prompt (``n`` each), in order."""
    b = state.batcher
    if plan.seed is None:
        flat = [p for p in plan.prompts for _ in range(plan.n)]
        recs = await b.generate(flat, plan.params, None)
        return [recs[i * plan.n : (i + 1) * plan.n] for i in range(len(plan.prompts))]
    # Seeded: each prompt on its own with the request's seed (vLLM: seeded outputs do not depend on
    # the other requests in the batch).
    return list(await asyncio.gather(*(b.generate([p] * plan.n, plan.params, plan.seed) for p in plan.prompts)))


@dataclass
class _Choice:
    token_ids: list[int]
    logprobs: list[float]
    heads_ids: list[list[int]]
    heads_lps: list[list[float]]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    extra_ids: list[int] | None = None  # the extra draw, one per generated token (when asked)


def _finish(state: ServeState, plan: _Plan, rec: CallRecord, skip_special: bool, include_stop_str: bool) -> _Choice:
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
                return _Choice(ids, lps, hid, hlp, text, "stop", s, None if extra is None else extra[: i + 1])
    if stopped_by_token:
        stop_reason = ids[-1] if ids[-1] in plan.explicit_stops else None
    return _Choice(ids, lps, hid, hlp, text, finish, stop_reason, extra)


def _positions(plan: _Plan, c: _Choice, upto: slice = slice(None)) -> list[list[tuple[int, float]]]:
    n = plan.n_logprobs or 0
    return [position_entries(t, lp, hi, hl, n)
            for t, lp, hi, hl in zip(c.token_ids[upto], c.logprobs[upto], c.heads_ids[upto], c.heads_lps[upto])]


def _token_str(state: ServeState, as_ids: bool):
    return token_id_string if as_ids else state.tokens.piece


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def _deltas(state: ServeState, c: _Choice, skip_special: bool) -> list[str]:
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


# ----------------------------------------------------------------------------- handlers


def _error(exc: ProtocolError | str, status: int | None = None) -> JSONResponse:
    if isinstance(exc, ProtocolError):
        return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)
    status = status or 400
    return JSONResponse(error_body(str(exc), status), status_code=status)


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    return body


def _validate(model_cls, body: dict):
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise ProtocolError(f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")),
                            param=loc or None) from None


def _check_model(state: ServeState, model: str | None) -> None:
    if model is not None and model != state.info.name:
        raise ProtocolError(f"The model `{model}` does not exist.", status=404, param="model")


def _tokenize(state: ServeState, text: str, add_special_tokens: bool) -> list[int]:
    tok = state.engine.tokenizer
    return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])


def _completion_prompts(state: ServeState, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
    p = req.prompt
    if p is None or p == "" or p == []:
        raise ProtocolError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
    if isinstance(p, str):
        items: list = [p]
    elif all(isinstance(x, int) for x in p):
        items = [list(p)]
    else:
        items = list(p)
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids = _tokenize(state, item, req.add_special_tokens)
            texts.append(item)
        else:
            ids = [int(x) for x in item]
            if any(x < 0 for x in ids):
                raise ProtocolError("prompt token ids must be non-negative", param="prompt")
            texts.append(None)
        if not ids:
            raise ProtocolError("the prompt is empty after tokenization", param="prompt")
        prompts.append(ids)
    return prompts, texts


async def completions(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    try:
        req = _validate(CompletionRequest, await _json_body(request))
        _check_model(state, req.model)
        prompts, texts = _completion_prompts(state, req)
        plan = _plan(state, req, "completion", prompts, texts)
        results = await _run(state, plan)
    except ProtocolError as exc:
        return _error(exc)
    except ValueError as exc:  # the engine rejected the input
        return _error(str(exc), 400)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    as_ids = bool(req.return_tokens_as_token_ids)
    tstr = _token_str(state, as_ids)
    choices = [[_finish(state, plan, r, req.skip_special_tokens, req.include_stop_str_in_output) for r in recs]
               for recs in results]
    model = state.info.name
    if req.stream:
        return StreamingResponse(_completion_stream(state, req, plan, choices, rid, created, model, tstr),
                                 media_type="text/event-stream")
    out, n_prompt, n_gen = [], 0, 0
    for pi, cs in enumerate(choices):
        n_prompt += len(plan.prompts[pi])
        for c in cs:
            lp = None
            if plan.n_logprobs is not None:
                lp = completion_logprobs(c.token_ids, _positions(plan, c), plan.n_logprobs, tstr)
            item = {
                "index": len(out), "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if req.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": plan.prompts[pi] if req.return_token_ids else None,
            }
            if plan.extra_draw:
                item[EXTRA_IDS_FIELD] = c.extra_ids
            out.append(item)
            n_gen += len(c.token_ids)
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
        "service_tier": None, "system_fingerprint": None, "usage": _usage(n_prompt, n_gen),
        "kv_transfer_params": None,
    })


async def _completion_stream(state, req, plan, choices, rid, created, model, tstr):
    n_prompt = n_gen = 0
    index = 0
    for pi, cs in enumerate(choices):
        n_prompt += len(plan.prompts[pi])
        for c in cs:
            deltas = _deltas(state, c, req.skip_special_tokens)
            offset = 0
            for t in range(len(c.token_ids)):
                last = t == len(c.token_ids) - 1
                lp = None
                if plan.n_logprobs is not None:
                    lp = completion_logprobs(c.token_ids[t : t + 1], _positions(plan, c, slice(t, t + 1)),
                                             plan.n_logprobs, tstr, initial_text_offset=offset)
                item = {
                    "index": index, "text": deltas[t], "logprobs": lp,
                    "finish_reason": c.finish_reason if last else None,
                    "stop_reason": c.stop_reason if last else None,
                    "prompt_token_ids": plan.prompts[pi] if (req.return_token_ids and t == 0) else None,
                    "token_ids": c.token_ids[t : t + 1] if req.return_token_ids else None,
                }
                if plan.extra_draw:
                    item[EXTRA_IDS_FIELD] = c.extra_ids[t : t + 1]
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [item], "usage": None})
                offset += len(deltas[t])
            n_gen += len(c.token_ids)
            index += 1
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": _usage(n_prompt, n_gen)})
    yield SSE_DONE


def _render_chat(state: ServeState, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    tok = state.engine.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise ProtocolError("the tokenizer has no chat template")
    messages = [{"role": m.role, "content": message_content(m.content)} for m in req.messages]
    if req.continue_final_message and req.add_generation_prompt:
        raise ProtocolError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    try:
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
    except Exception as exc:  # template errors are the client's
        raise ProtocolError(f"chat template error: {exc}") from None
    return text, _tokenize(state, text, req.add_special_tokens)


def _chat_message(c: _Choice) -> dict:
    return {"role": "assistant", "content": c.text, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [], "reasoning_content": None}


async def chat_completions(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    try:
        req = _validate(ChatCompletionRequest, await _json_body(request))
        _check_model(state, req.model)
        text, ids = _render_chat(state, req)
        if not ids:
            raise ProtocolError("the rendered chat prompt is empty", param="messages")
        plan = _plan(state, req, "chat", [ids], [text])
        results = await _run(state, plan)
    except ProtocolError as exc:
        return _error(exc)
    except ValueError as exc:
        return _error(str(exc), 400)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    tstr = _token_str(state, bool(req.return_tokens_as_token_ids))
    choices = [_finish(state, plan, r, req.skip_special_tokens, req.include_stop_str_in_output) for r in results[0]]
    model = state.info.name
    if req.stream:
        return StreamingResponse(_chat_stream(state, req, plan, choices, rid, created, model, tstr, text),
                                 media_type="text/event-stream")
    out = []
    for i, c in enumerate(choices):
        lp = None
        if plan.n_logprobs is not None:
            lp = chat_logprobs(c.token_ids, _positions(plan, c), plan.n_logprobs, tstr, state.tokens.piece)
        item = {"index": i, "message": _chat_message(c), "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, "token_ids": c.token_ids if req.return_token_ids else None}
        if plan.extra_draw:
            item[EXTRA_IDS_FIELD] = c.extra_ids
        out.append(item)
    n_gen = sum(len(c.token_ids) for c in choices)
    body = {
        "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
        "service_tier": None, "system_fingerprint": None, "usage": _usage(len(ids), n_gen),
        "prompt_logprobs": None, "prompt_token_ids": ids if req.return_token_ids else None,
        "kv_transfer_params": None,
    }
    body["prompt_text"] = text if req.return_prompt_text else None
    return JSONResponse(body)


async def _chat_stream(state, req, plan, choices, rid, created, model, tstr, prompt_text):
    ids = plan.prompts[0]

    def chunk(choice: dict, **top) -> bytes:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice], "usage": None, "prompt_token_ids": None, "prompt_text": None, **top})

    first = True
    for i, c in enumerate(choices):
        extra = {}
        if first and req.return_token_ids:  # vLLM: in the first chunk only
            extra["prompt_token_ids"] = ids
        if first and req.return_prompt_text:
            extra["prompt_text"] = prompt_text
        first = False
        yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}, **extra)
        deltas = _deltas(state, c, req.skip_special_tokens)
        for t in range(len(c.token_ids)):
            last = t == len(c.token_ids) - 1
            lp = None
            if plan.n_logprobs is not None:
                lp = chat_logprobs(c.token_ids[t : t + 1], _positions(plan, c, slice(t, t + 1)), plan.n_logprobs,
                                   tstr, state.tokens.piece)
            item = {"index": i, "delta": {"content": deltas[t]}, "logprobs": lp,
                    "finish_reason": c.finish_reason if last else None,
                    "stop_reason": c.stop_reason if last else None,
                    "token_ids": c.token_ids[t : t + 1] if req.return_token_ids else None}
            if plan.extra_draw:
                item[EXTRA_IDS_FIELD] = c.extra_ids[t : t + 1]
            yield chunk(item)
    if req.stream_options is not None and req.stream_options.include_usage:
        n_gen = sum(len(c.token_ids) for c in choices)
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": _usage(len(ids), n_gen)})
    yield SSE_DONE


async def models(request: Request) -> Response:
    info: ModelInfo = request.app.state.serve.info
    return JSONResponse({"object": "list", "data": [{
        "id": info.name, "object": "model", "created": info.created, "owned_by": "prodrl",
        "root": info.model_dir, "parent": None, "max_model_len": info.max_model_len, "permission": [],
    }]})


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def load_model(request: Request) -> Response:
    """Redeploy: load another checkpoint into the running server (between batches)."""
    state: ServeState = request.app.state.serve
    try:
        body = await _json_body(request)
    except ProtocolError as exc:
        return _error(exc)
    model_dir = body.get("model_dir")
    if not isinstance(model_dir, str) or not model_dir:
        return _error(ProtocolError("`model_dir` (a checkpoint directory) is required", param="model_dir"))
    name = body.get("served_model_name") or model_dir

    def swap():
        engine = load_engine(model_dir, state.device)
        info = ModelInfo.from_engine(engine, model_dir, name, state.generation_config)
        state.batcher.engine = engine  # on the engine thread: strictly between batches
        state.info = info
        state.tokens = _Tokens(engine.tokenizer)
        return info

    try:
        info = await state.batcher.call(swap)
    except (OSError, ValueError) as exc:
        return _error(ProtocolError(f"cannot load {model_dir}: {exc}", param="model_dir"))
    return JSONResponse({"status": "ok", "model": info.name, "model_dir": info.model_dir})


async def stats(request: Request) -> Response:
    s = request.app.state.serve.batcher.stats
    return JSONResponse({"requests": s.requests, "generate_calls": s.generate_calls, "prompts": s.prompts})


class _ApiKeyMiddleware:
    """vLLM's ``--api-key``: routes under ``/v1`` need ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = JSONResponse({"error": "Unauthorized"}, status_code=401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine,
    *,
    model_dir: str | os.PathLike | None = None,
    served_model_name: str | None = None,
    max_logprobs: int = 20,
    api_key: str | None = None,
    batch_wait_ms: float = 10.0,
    max_batch_size: int = 64,
    generation_config: str = "auto",
    device: str = "cpu",
    batch_quiet_ms: float = 1.0,
) -> Starlette:
    """The ASGI app serving ``engine`` (a ``LocalEngine`` or anything with its interface)."""
    name = served_model_name or (str(model_dir) if model_dir else "prodrl-local")
    info = ModelInfo.from_engine(engine, str(model_dir) if model_dir else None, name, generation_config)
    state = ServeState(engine, info, max_logprobs=max_logprobs, api_key=api_key, batch_wait_ms=batch_wait_ms,
                       max_batch_size=max_batch_size, generation_config=generation_config, device=device,
                       batch_quiet_ms=batch_quiet_ms)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        await state.batcher.start()
        try:
            yield
        finally:
            await state.batcher.stop()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/load_model", load_model, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.serve = state
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, key=api_key)
    return app


# ----------------------------------------------------------------------------- running


class BackgroundServer:
    """Run an ASGI app with uvicorn on a background thread (tests, benchmarks). ``port=0`` picks a
    free port; ``url`` is the base URL once started. Use as a context manager, or ``start``/``stop``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 timeout_keep_alive: int = KEEP_ALIVE_S) -> None:
        import uvicorn

        self.host = host
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                     loop="asyncio", http="h11", access_log=False, timeout_graceful_shutdown=5,
                                     timeout_keep_alive=timeout_keep_alive)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="prodrl-uvicorn", daemon=True)
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve a checkpoint with vLLM's OpenAI-compatible API (local engine)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model_dir", help="HF checkpoint directory (model + tokenizer), e.g. an export")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: model_dir)")
    s.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs/top_logprobs allowed (vLLM: 20)")
    s.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="require this bearer token on /v1")
    s.add_argument("--batch-wait-ms", type=float, default=10.0,
                   help="longest wait to fill a batch (it closes earlier after 1 ms without a new request)")
    s.add_argument("--batch-quiet-ms", type=float, default=1.0,
                   help="close a batch after this long without a new request")
    s.add_argument("--max-batch-size", type=int, default=64, help="most prompts per engine call")
    s.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: sampling defaults from generation_config.json (as vLLM); vllm: ignore them")
    s.add_argument("--device", default="cpu")
    s.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: tiny models on shared CPUs were measured ~10x "
                        "slower with 2 OpenMP threads; 0 keeps torch's default)")
    s.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open (above the clients' reuse window)")
    s.add_argument("--log-level", default="warning")
    s.set_defaults(fn=cmd_serve)
    return s


def cmd_serve(args) -> int:
    import uvicorn

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = load_engine(args.model_dir, args.device)
    app = build_app(engine, model_dir=args.model_dir, served_model_name=args.served_model_name,
                    max_logprobs=args.max_logprobs, api_key=args.api_key, batch_wait_ms=args.batch_wait_ms,
                    max_batch_size=args.max_batch_size, generation_config=args.generation_config, device=args.device,
                    batch_quiet_ms=args.batch_quiet_ms)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_keep_alive=args.timeout_keep_alive)
    return 0
