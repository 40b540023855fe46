"""The recorder's HTTP surface: the proxied OpenAI routes, feedback, stats, bearer auth, the app."""

from __future__ import annotations

import asyncio
import json
import math
import time
from contextlib import asynccontextmanager

import aiohttp
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from prodrl_pipelines.engines.openai_protocol import ProtocolError, error_body
from prodrl_pipelines.config.preflight import redact
from prodrl_pipelines.recorder.answers import Rewriter
from prodrl_pipelines.recorder.chat_extend import extend_refusal, extender_of, serve_extended
from prodrl_pipelines.recorder.calls import (
    SESSION_PARAM,
    UPSTREAM_SHAPE_ERRORS,
    Caller,
    attempt_of,
    check_answer_shape,
    clip,
    dumps,
    err,
    n_up,
    read_call_body,
    session_of,
    tenant_of,
    upstream_error,
    upstream_unavailable,
    url_session,
)
from prodrl_pipelines.recorder.indexer import IndexerUnavailable
from prodrl_pipelines.recorder.counters import Stats
from prodrl_pipelines.recorder.requests import Unrecordable, client_ask, is_json_number, unrecordable_reason
from prodrl_pipelines.recorder.messages import MessagesShape
from prodrl_pipelines.recorder.metrics import CONTENT_TYPE
from prodrl_pipelines.observability.asgi import RequestObserver
from prodrl_pipelines.recorder.request_context import CURRENT, RequestContext
from prodrl_pipelines.recorder.request_log import RequestLog
from prodrl_pipelines.recorder.responses import ResponsesShape
from prodrl_pipelines.recorder.service import Recorder, RecorderConfig
from prodrl_pipelines.recorder.streaming import proxy_stream
from prodrl_pipelines.recorder.tenants import Tenant, Tenants
from prodrl_pipelines.trajectories.store import name_problem


# the APIs recorded as chat calls: the request translated to chat, the answer back (recorder.responses,
# recorder.messages)
SHAPES = {"responses": ResponsesShape, "messages": MessagesShape}


async def _proxy(request: Request, kind: str) -> Response:
    """One proxied call; ``kind``: completion, chat, or one of ``SHAPES`` (recorded as chat)."""
    rec: Recorder = request.app.state.recorder
    stats = rec.stats
    tenant = tenant_of(request)
    stats.count("requests", tenant=tenant.name)
    t0 = time.perf_counter()
    try:
        body, raw = await read_call_body(request)
        client_tid, source = session_of(request)
        stats.count(f"session_source_{source}", tenant=tenant.name)
        caller = Caller(tenant, client_tid, tenant.stored_id(client_tid), attempt_of(request, raw))
        shape = None
        if kind in SHAPES:
            shape = SHAPES[kind](body)
            body, kind = shape.chat_request(), "chat"
    except ProtocolError as exc:
        return err(str(exc), exc.status, stats, "too_large_requests" if exc.status == 413 else "bad_requests")
    pv = request.headers.get("x-policy-version")
    task_id = request.headers.get("x-task-id")
    problem = name_problem(pv, "X-Policy-Version") if pv is not None else None
    if problem:
        return err(problem, 400, stats, "bad_requests")
    if task_id is not None and len(task_id) > 1024:
        return err("X-Task-Id must be at most 1024 characters", 400, stats, "bad_requests")
    if rec.tokens is None:
        await rec.find_tokenizer()  # token strings as text, not token_id:<id>, once the upstream tells
    served = rec.served_model()
    if served is not None:  # the client's model name is not the deployment's: ask for what is served now
        body["model"] = served
    ask = client_ask(body, kind)
    if kind == "chat" and rec.cfg.chat_history == "extend" and source != "none":
        ext = extender_of(rec)
        why = "no_tokenizer" if ext is None else extend_refusal(body)
        if why is None:
            try:
                return await serve_extended(rec, ext, body, caller, pv, task_id, ask, shape, request)
            except ProtocolError as exc:
                return err(str(exc), exc.status, stats, "bad_requests")
        stats.inc(f"extend_skipped.{why}")
    reason = unrecordable_reason(body, kind)
    up = body if reason else rec.force(body, kind, ask)
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    headers = {"X-Trajectory-Id": client_tid}
    assert rec.http is not None
    if body.get("stream"):
        return await proxy_stream(rec, kind, path, up, ask, reason, caller, pv, task_id, shape)
    t1 = time.perf_counter()
    try:
        status, ctype, content = await rec.read_upstream(path.lstrip("/"), up, caller.tid)
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        return upstream_unavailable(exc, stats, headers)
    t2 = time.perf_counter()
    if status != 200:
        return upstream_error(status, content, ctype, headers, stats)
    try:
        data = json.loads(content)
    except ValueError:
        return err("the upstream answer is not JSON", 502, stats, "upstream_bad_answers", headers)
    row = None
    try:
        check_answer_shape(data)
        if reason is None:
            try:
                row = rec.build_row(kind, data, up, pv, task_id)
            except Unrecordable as u:
                reason = u.reason
        if shape is not None:
            first = data["choices"][0]
            usage = shape.usage(data.get("prompt_token_ids"), first.get("token_ids"), data.get("usage"))
        answer = Rewriter(kind, ask, rec.tokens, stats, n_up(up, kind)).rewrite(data) if up is not body else data
        if shape is not None:
            answer = shape.answer(answer, usage)
    except UPSTREAM_SHAPE_ERRORS as exc:  # the upstream said 200 but its answer is not an OpenAI answer
        return err(f"the upstream server's answer is malformed ({type(exc).__name__}: {exc})", 502, stats,
                    "upstream_bad_answers", headers)
    payload = dumps(answer)
    t3 = time.perf_counter()
    if await request.is_disconnected():  # the client gave up (a timeout): its retry is the call, not this
        stats.count("client_disconnected", tenant=tenant.name)
        return err("the client disconnected before the answer", 499, headers=headers)
    try:
        index = await rec.commit(caller.tid, row, reason, caller.attempt, tenant.name)
    except Exception as exc:  # the WAL failed: the client must not believe the call was recorded
        return err(f"the call could not be recorded durably: {exc}", 503, stats, "commit_failures", headers)
    rec.time_call(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
    headers.update({"X-Call-Index": str(index), "X-Prodrl-Recorded": "true" if row is not None else "false"})
    return Response(payload, media_type="application/json", headers=headers)


async def completions(request: Request) -> Response:
    return await _proxy(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _proxy(request, "chat")


async def responses(request: Request) -> Response:
    return await _proxy(request, "responses")


async def messages(request: Request) -> Response:
    return await _proxy(request, "messages")


async def count_tokens(request: Request) -> Response:
    """Anthropic's ``messages.count_tokens`` (Claude Code calls it): the input tokens the call would
    be sent as, its chat translation rendered with the deployment's chat template and counted, as
    vLLM 0.32 counts them. Not a call: nothing is forwarded or recorded."""
    rec: Recorder = request.app.state.recorder
    stats = rec.stats
    stats.count("count_tokens_requests", tenant=tenant_of(request).name)
    try:
        url_session(request)
        body, _ = await read_call_body(request)
        chat = MessagesShape({**body, "max_tokens": 1, "stream": False}).chat_request()  # no answer: no length
    except ProtocolError as exc:
        return err(str(exc), exc.status, stats, "bad_requests")
    if rec.tokens is None:
        await rec.find_tokenizer()
    ext = extender_of(rec)
    if ext is None:
        return err("counting tokens needs the served model's tokenizer, and the upstream has not named it "
                   "(pass --tokenizer, or follow a deployment)", 503, stats, "count_tokens_unavailable")
    if not isinstance(chat.get("chat_template_kwargs") or {}, dict):
        return err("`chat_template_kwargs` must be an object", 400, stats, "bad_requests")
    try:
        n = len(ext.rendered_ids(chat, ext.tool_plan(chat)))
    except ProtocolError as exc:
        return err(str(exc), exc.status, stats, "bad_requests")
    except Exception as exc:  # noqa: BLE001 - the template refused these messages (jinja raises its own errors)
        return err(f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}", 400, stats,
                   "bad_requests")
    return JSONResponse({"input_tokens": n})


async def models(request: Request) -> Response:
    rec: Recorder = request.app.state.recorder
    assert rec.http is not None
    try:
        url_session(request)
    except ProtocolError as exc:
        return err(str(exc), exc.status, rec.stats, "bad_requests")
    try:
        async with rec.http.get(rec.upstream_url("v1/models")) as resp:
            return Response(await resp.read(), status_code=resp.status, media_type=resp.headers.get("content-type"))
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        return upstream_unavailable(exc, rec.stats)


async def feedback(request: Request) -> Response:
    rec: Recorder = request.app.state.recorder
    stats = rec.stats
    tenant = tenant_of(request)
    try:
        session = url_session(request)
        body, _ = await read_call_body(request)
    except ProtocolError as exc:
        return err(str(exc), exc.status, stats, "feedback_bad_requests")
    tid = body.get("trajectory_id", session)  # under a session-scoped URL the trajectory defaults to the session
    reward, source = body.get("reward"), body.get("source", "feedback")
    if not isinstance(tid, str) or not tid:
        return err("`trajectory_id` (a non-empty string) is required", 422, stats, "feedback_invalid")
    if not is_json_number(reward) or not math.isfinite(float(reward)):
        return err(f"`reward` must be a finite number, got {reward!r}", 422, stats, "feedback_invalid")
    if not isinstance(source, str) or not source:
        return err("`source` must be a non-empty string", 422, stats, "feedback_invalid")
    stored = tenant.stored_id(tid)  # a tenant names only its own trajectories
    try:
        known = await rec.ingestor.known_async(stored)
    except IndexerUnavailable as exc:
        return err(f"the reward could not be recorded: {exc}", 503, stats, "commit_failures")
    if not known:
        stats.count("feedback_unknown_trajectory", tenant=tenant.name)
        return err(f"unknown trajectory {clip(tid)}: no call was recorded under it", 404)
    created, fut = rec.ingestor.commit_reward(stored, float(reward), source)
    try:
        await fut
    except Exception as exc:
        return err(f"the reward could not be recorded durably: {exc}", 503, stats, "commit_failures")
    stats.count("rewards_recorded", tenant=tenant.name)
    return JSONResponse({"trajectory_id": tid, "reward": float(reward), "source": source, "created_at_us": created})


def _visible_counters(rec: Recorder, tenant: Tenant) -> tuple[dict, dict]:
    """(global counters, per-tenant counters) a tenant may see: an admin every tenant's, others their own."""
    counters, tenants = {"tokens_file_errors": rec.tenants.errors}, {}
    for name, v in rec.stats.as_dict().items():
        if name.startswith("tenant."):
            t, _, c = name[len("tenant."):].partition(".")
            if tenant.admin or t == tenant.name:
                tenants.setdefault(t, {})[c] = v
        else:
            counters[name] = v
    return counters, tenants


async def stats_route(request: Request) -> Response:
    rec: Recorder = request.app.state.recorder
    counters, tenants = _visible_counters(rec, tenant_of(request))
    return JSONResponse({"counters": counters, "tenants": tenants, "policy_version": rec.cfg.policy_version,
                         "upstream": redact(rec.cfg.upstream) if rec.cfg.upstream else f"follows {rec.cfg.follow}", "top_logprobs": rec.cfg.top_logprobs,
                         "tokenizer": rec.tokenizer_source or "none (token strings stay token_id:<id>; pass --tokenizer)",
                         "chat_top_logprobs": rec.chat_k, "record_extra_draw": rec.cfg.record_extra_draw,
                         # the deployment's replicas as the balancer sees them (followed endpoint file)
                         "replicas_down": rec.balancer.down(), "in_flight": rec.balancer.outstanding(),
                         "routing": {"version_crossings": rec.balancer.crossings,
                                     "replica_moves": rec.balancer.sticky_moves}})


async def metrics(request: Request) -> Response:
    """Prometheus text (recorder.metrics): open, like vLLM's, for a scraper without a tenant's token."""
    rec: Recorder = request.app.state.recorder
    return Response(rec.metrics.exposition(), media_type=CONTENT_TYPE)


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def health_live(request: Request) -> Response:
    """Liveness: the process answers (its event loop runs). No token, no rate limit (a kubelet)."""
    return JSONResponse({"status": "live"})


async def health_ready(request: Request) -> Response:
    """Readiness: 200 when calls can be answered and recorded, else 503; each check says why. No
    token, no rate limit."""
    rec: Recorder = request.app.state.recorder
    checks = {name: {"ok": ok, "detail": detail} for name, (ok, detail) in rec.readiness().items()}
    ready = all(c["ok"] for c in checks.values())
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


# routes a probe or a scraper reaches without a token or a rate limit (the rest, /health included, need one)
OPEN_PATHS = frozenset({"/health/live", "/health/ready", "/metrics"})


class _BearerAuth:
    """Every route but the probes (``OPEN_PATHS``) needs a tenant's token, as ``Authorization: Bearer
    <token>`` or as Anthropic's clients send it, ``x-api-key: <token>`` (401 otherwise, nothing is
    recorded), within the tenant's rate limit (429 with ``Retry-After`` otherwise)."""

    def __init__(self, app, tenants: Tenants, stats: Stats) -> None:
        self.app = app
        self.tenants = tenants
        self.stats = stats

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            headers = dict(scope["headers"])
            scheme, _, got = headers.get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 9110), the token is not
            tenant = self.tenants.authenticate(got.strip()) if scheme.lower() == b"bearer" else None
            if tenant is None and b"authorization" not in headers and headers.get(b"x-api-key"):
                tenant = self.tenants.authenticate(headers[b"x-api-key"].strip())
            if tenant is None:
                self.stats.inc("unauthorized")
                resp = JSONResponse(error_body("missing or wrong bearer token", 401), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
            wait = self.tenants.admit(tenant)
            if wait > 0.0:
                self.stats.count("rate_limited", tenant=tenant.name)
                resp = JSONResponse(error_body(f"tenant {tenant.name!r} is over its rate limit of "
                                               f"{tenant.requests_per_s:g} requests/s", 429), status_code=429,
                                    headers={"Retry-After": str(max(1, int(wait + 0.999)))})
                await resp(scope, receive, send)
                return
            scope["prodrl.tenant"] = tenant
        await self.app(scope, receive, send)


class _SessionConvertor(Convertor):
    """A path segment, empty included, so that ``/s//v1/...`` is a 400 naming the session (not a 404)."""

    regex = "[^/]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("prodrl_session", _SessionConvertor())
SESSION_PREFIX = f"/s/{{{SESSION_PARAM}:prodrl_session}}"


def build_recorder_app(config: RecorderConfig) -> Starlette:
    rec = Recorder(config)
    log = RequestLog(config.request_log) if config.request_log else None

    def request_started(scope) -> RequestContext:
        ctx = RequestContext.of(scope)
        if config.request_metrics:
            rec.metrics.started(ctx)
        return ctx

    def request_done(ctx: RequestContext, scope) -> None:
        ctx.tenant = getattr(scope.get("prodrl.tenant"), "name", None)  # set by the token check
        if config.request_metrics:
            rec.metrics.observe(ctx)
        if log is not None:
            try:
                log.write(ctx)
            except (OSError, ValueError):  # a full disk: the call was answered and recorded all the same
                rec.stats.inc("request_log_errors")

    @asynccontextmanager
    async def lifespan(app):
        await rec.start()  # replays the WAL before the server accepts connections
        try:
            yield
        finally:
            await rec.stop()
            if log is not None:
                log.close()

    api = [("/v1/completions", completions, "POST"), ("/v1/chat/completions", chat_completions, "POST"),
           ("/v1/responses", responses, "POST"), ("/v1/messages", messages, "POST"),
           ("/v1/messages/count_tokens", count_tokens, "POST"), ("/v1/models", models, "GET"), ("/v1/feedback", feedback, "POST")]
    # each OpenAI route also under a session-scoped base URL: /s/<session>/v1/... (calls.SESSION_SOURCES)
    routes = [Route(prefix + path, fn, methods=[method]) for prefix in ("", SESSION_PREFIX) for path, fn, method in api]
    routes += [
        Route("/stats", stats_route, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health/live", health_live, methods=["GET"]),
        Route("/health/ready", health_ready, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        404: lambda request, exc: err(f"no route {clip(request.url.path)}", 404),
        405: lambda request, exc: err(f"{request.method} is not allowed on {clip(request.url.path)}", 405)})
    app.state.recorder = rec
    app.add_middleware(_BearerAuth, tenants=rec.tenants, stats=rec.stats)
    if config.request_metrics or log is not None:
        # outermost: a request refused by the token check or the rate limit is counted and logged too
        app.add_middleware(RequestObserver, begin=request_started, done=request_done, current=CURRENT)
    return app
