"""``prodrl serve``: the local engine behind vLLM's OpenAI-compatible HTTP API (DESIGN.md s.7).

Routes: ``POST /v1/completions`` (prompt as text, token ids, or a list of either),
``POST /v1/chat/completions`` (messages and tools rendered with the tokenizer's chat template,
``chat_endpoint``), both streaming (SSE) and not; ``GET /v1/models``; ``GET /health`` (and the probes
``/health/live``, ``/health/ready``, open like it); ``GET /metrics`` (vLLM's metric names, open:
``serve_metrics``); ``POST /v1/load_model {"model_dir": ...}`` to
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

Tools: ``tools``, ``tool_choice`` (``none``, ``auto``, ``required``, a named function) and
``parallel_tool_calls``, with the model's reasoning and tool-call parser named by ``--reply-parser``
(vLLM's ``--reasoning-parser`` and ``--tool-call-parser``); see ``chat_tools``.

Known differences from vLLM (documented, deliberate or not yet needed):

* Streaming is simulated: the whole completion is generated, then sent as one chunk per token (vLLM's
  events, the same bytes), all in one write.
* Not supported (400): penalties, ``min_p``, ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
  beam search, ``best_of``, ``echo``, ``suffix``, ``prompt_logprobs``, structured outputs and
  non-text message parts. A forced tool choice opens the call in the prompt instead of guided
  decoding (``chat_tools``). ``temperature < 1e-5`` (vLLM: greedy) is served as top-k 1 at
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

import asyncio
import hmac
import os
import threading
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prodrl_pipelines.engines.chat_endpoint import chat_completions
from prodrl_pipelines.engines.openai_protocol import (
    EXTRA_IDS_FIELD,
    ROUTED_EXPERTS_FIELD,
    SSE_DONE,
    CompletionRequest,
    ProtocolError,
    completion_logprobs,
    sse,
)
from prodrl_pipelines.engines.reply_parsers import TOOL_FORMATS
from prodrl_pipelines.engines import serve_adapters
from prodrl_pipelines.engines.serve_http import check_model, error_response, json_body, tokenize, validate, whole_stream
from prodrl_pipelines.engines.serve_plan import (
    choice_positions,
    finish_choice,
    plan_request,
    run_plan,
    text_deltas,
    token_formatter,
    usage_block,
)
from prodrl_pipelines.engines.serve_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from prodrl_pipelines.engines.serve_metrics import CURRENT as METRICS_REQUEST
from prodrl_pipelines.observability.asgi import RequestObserver
from prodrl_pipelines.engines.serve_state import ModelInfo, ServeState, TokenDecoder, load_engine

__all__ = ["build_app", "BackgroundServer", "KEEP_ALIVE_S"]

# How long an idle keep-alive connection is kept open (uvicorn's default is 5 s). It must exceed how
# long clients keep idle connections for reuse (httpx 5 s, aiohttp 15 s): with equal timeouts a
# client reuses a connection just as the server closes it, and the request is lost ("Server
# disconnected" / "Connection reset by peer"; uvloop even runs an expired timer before reading a
# request already in the socket). Measured at 128-256 concurrent clients on 2 shared cores: a
# client -> server connection sat idle ~5 s hundreds of times per minute.
KEEP_ALIVE_S = 120


# ----------------------------------------------------------------------------- handlers


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
            ids = tokenize(state, item, req.add_special_tokens)
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
        req = validate(CompletionRequest, await json_body(request))
        check_model(state, req.model)
        # tokenization off the event loop: a long prompt does not hold every other client
        prompts, texts = await asyncio.to_thread(_completion_prompts, state, req)
        plan = plan_request(state, req, "completion", prompts, texts)
        results = await run_plan(state, plan)
    except ProtocolError as exc:
        return error_response(exc)
    except ValueError as exc:  # the engine rejected the input
        return error_response(str(exc), 400)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    as_ids = bool(req.return_tokens_as_token_ids)
    tstr = token_formatter(state, as_ids)
    choices = [[finish_choice(state, plan, r, req.skip_special_tokens, req.include_stop_str_in_output) for r in recs]
               for recs in results]
    model = plan.model or state.info.name
    if req.stream:
        return StreamingResponse(whole_stream(_completion_stream(state, req, plan, choices, rid, created, model, tstr)),
                                 media_type="text/event-stream")
    out, n_prompt, n_gen = [], 0, 0
    for pi, cs in enumerate(choices):
        n_prompt += len(plan.prompts[pi])
        for c in cs:
            lp = None
            if plan.n_logprobs is not None:
                lp = completion_logprobs(c.token_ids, choice_positions(plan, c), plan.n_logprobs, tstr)
            item = {
                "index": len(out), "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if req.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": plan.prompts[pi] if req.return_token_ids else None,
            }
            if plan.extra_draw:
                item[EXTRA_IDS_FIELD] = c.extra_ids
            if state.return_routed_experts:
                item[ROUTED_EXPERTS_FIELD] = c.routed_experts
            out.append(item)
            n_gen += len(c.token_ids)
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
        "service_tier": None, "system_fingerprint": None, "usage": usage_block(n_prompt, n_gen),
        "kv_transfer_params": None,
    })


def _completion_stream(state, req, plan, choices, rid, created, model, tstr):
    n_prompt = n_gen = 0
    index = 0
    for pi, cs in enumerate(choices):
        n_prompt += len(plan.prompts[pi])
        for c in cs:
            deltas = text_deltas(state, c, req.skip_special_tokens)
            offset = 0
            for t in range(len(c.token_ids)):
                last = t == len(c.token_ids) - 1
                lp = None
                if plan.n_logprobs is not None:
                    lp = completion_logprobs(c.token_ids[t : t + 1], choice_positions(plan, c, slice(t, t + 1)),
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
                if state.return_routed_experts and last:  # known once the request finished (as vLLM)
                    item[ROUTED_EXPERTS_FIELD] = c.routed_experts
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [item], "usage": None})
                offset += len(deltas[t])
            n_gen += len(c.token_ids)
            index += 1
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": usage_block(n_prompt, n_gen)})
    yield SSE_DONE


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": serve_adapters.model_cards(request.app.state.serve)})


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def health_live(request: Request) -> Response:
    """Liveness: the process answers (its event loop runs). Open, as vLLM's ``/health`` is."""
    return JSONResponse({"live": True})


async def health_ready(request: Request) -> Response:
    """Readiness: 503 with the reason while the server cannot take calls: its batching loop is not
    running (not started, or it died: the error), or ``/v1/load_model`` is replacing the weights
    (calls wait behind the load meanwhile)."""
    state: ServeState = request.app.state.serve
    task = state.batcher.task
    if task is None:
        batching = {"ok": False, "reason": "the batching loop is not running"}
    elif task.done():
        exc = None if task.cancelled() else task.exception()
        batching = {"ok": False, "reason": f"the batching loop stopped: {type(exc).__name__}: {exc}" if exc
                    else "the batching loop stopped"}
    else:
        batching = {"ok": True}
    model = {"ok": state.loading is None, "served": state.info.name,
             **({"reason": f"loading {state.loading}"} if state.loading else {})}
    checks = {"batching": batching, "model": model}
    ready = all(c["ok"] for c in checks.values())
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


async def load_model(request: Request) -> Response:
    """Redeploy: load another checkpoint into the running server (between batches). It replaces
    what every client is served, so it exists only on a server started with ``--api-key``."""
    state: ServeState = request.app.state.serve
    if not state.api_key:
        return error_response("POST /v1/load_model replaces the served weights: start prodrl serve with --api-key "
                      "(or $VLLM_API_KEY) to enable it", 403)
    try:
        body = await json_body(request)
    except ProtocolError as exc:
        return error_response(exc)
    model_dir = body.get("model_dir")
    if not isinstance(model_dir, str) or not model_dir:
        return error_response(ProtocolError("`model_dir` (a checkpoint directory) is required", param="model_dir"))
    name = body.get("served_model_name") or model_dir

    def swap():
        engine = load_engine(model_dir, state.device)
        info = ModelInfo.from_engine(engine, model_dir, name, state.generation_config)
        state.batcher.engine = engine  # on the engine thread: strictly between batches
        state.info = info
        state.tokens = TokenDecoder(engine.tokenizer)
        return info

    state.loading = model_dir
    try:
        info = await state.batcher.call(swap)
    except (OSError, ValueError) as exc:
        return error_response(ProtocolError(f"cannot load {model_dir}: {exc}", param="model_dir"))
    finally:
        state.loading = None
    return JSONResponse({"status": "ok", "model": info.name, "model_dir": info.model_dir})


async def metrics(request: Request) -> Response:
    """vLLM's metric names for what this server has (``serve_metrics``); open, as vLLM's is."""
    return Response(request.app.state.serve.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)


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
    max_body_bytes: int | None = None,
    return_routed_experts: bool = False,
    reply_parser: str | None = None,
    enable_lora: bool = False,
    lora_modules: list[str] = (),
) -> Starlette:
    """The ASGI app serving ``engine`` (a ``LocalEngine`` or anything with its interface).
    ``reply_parser``: the model's reasoning and tool-call format (``reply_parsers.TOOL_FORMATS``;
    None or ``none``: replies are plain content and only ``tool_choice: none`` is served).
    ``enable_lora``: LoRA adapters by name (``serve_adapters``), ``lora_modules`` (``NAME=PATH``)
    loaded before the first request."""
    if reply_parser not in (None, "none") and reply_parser not in TOOL_FORMATS:
        raise ValueError(f"unknown reply parser {reply_parser!r}; valid: none, {', '.join(sorted(TOOL_FORMATS))}")
    name = served_model_name or (str(model_dir) if model_dir else "prodrl-local")
    info = ModelInfo.from_engine(engine, str(model_dir) if model_dir else None, name, generation_config)
    state = ServeState(engine, info, max_logprobs=max_logprobs, api_key=api_key, batch_wait_ms=batch_wait_ms,
                       max_batch_size=max_batch_size, generation_config=generation_config, device=device,
                       batch_quiet_ms=batch_quiet_ms, max_body_bytes=max_body_bytes,
                       return_routed_experts=return_routed_experts)
    state.tool_format = TOOL_FORMATS.get(reply_parser or "none")
    if lora_modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for lora_name, lora_path in serve_adapters.parse_lora_modules(list(lora_modules)):
        serve_adapters.load(state, lora_name, lora_path)  # before serving: no batch runs yet

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
        *([Route("/v1/load_lora_adapter", serve_adapters.load_lora_adapter, methods=["POST"]),
           Route("/v1/unload_lora_adapter", serve_adapters.unload_lora_adapter, methods=["POST"])]
          if enable_lora else []),
        Route("/health", health, methods=["GET"]),
        Route("/health/live", health_live, methods=["GET"]),
        Route("/health/ready", health_ready, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.serve = state
    app.add_middleware(RequestObserver, begin=state.metrics.begin, done=state.metrics.done, current=METRICS_REQUEST)
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
