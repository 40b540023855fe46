"""Reading one client call: its JSON body (bounded), trajectory id (``SESSION_SOURCES``), retry identity
and tenant; the JSON error answers; what an upstream answer must look like before it is read."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from prodrl_pipelines.engines.openai_protocol import ProtocolError, error_body, read_body
from prodrl_pipelines.config.preflight import redact
from prodrl_pipelines.recorder.balancer import NoDeploymentYet
from prodrl_pipelines.recorder.counters import Stats
from prodrl_pipelines.recorder.ingest import Attempt
from prodrl_pipelines.recorder.requests import is_json_int
from prodrl_pipelines.recorder.tenants import Tenant

_TRAJECTORY_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")


def err(message: str, status: int, stats: Stats | None = None, counter: str | None = None,
         headers: dict | None = None) -> JSONResponse:
    if stats is not None and counter:
        stats.inc(counter)
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


# What a malformed upstream answer raises while it is read as an OpenAI answer.
UPSTREAM_SHAPE_ERRORS = (ProtocolError, KeyError, TypeError, ValueError, IndexError, AttributeError)


def clip(text: str, n: int = 80) -> str:
    """A client's value quoted in an error message, at most ``n`` characters of it."""
    return repr(text[:n]) + (f"... ({len(text)} characters)" if len(text) > n else "")


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


MAX_INT_DIGITS = 20  # a JSON integer of a request (ids, seeds, counts) fits in 64 bits
_INT_BOUND = 10 ** MAX_INT_DIGITS


def check_answer_shape(data) -> None:
    """What every later read of an upstream answer relies on: a list of choice objects whose token id
    fields, when present, are lists of integers."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise ProtocolError("no list of choices")
    for c in data["choices"]:
        if not isinstance(c, dict):
            raise ProtocolError("a choice is not an object")
        for name in ("token_ids", "prompt_token_ids"):
            ids = c.get(name)
            if ids is not None and not (isinstance(ids, list) and all(is_json_int(t) for t in ids)):
                raise ProtocolError(f"choice {name} is not a list of integers")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(obj, path: str = "body") -> str | None:
    """Where in ``obj`` a string holds a lone surrogate (it cannot be written as UTF-8), or None."""
    stack = [(obj, path)]
    while stack:
        o, at = stack.pop()
        if isinstance(o, str):
            try:
                o.encode("utf-8")
            except UnicodeEncodeError:
                return at
        elif isinstance(o, dict):
            for k, v in o.items():
                stack.append((k, f"{at} key"))
                stack.append((v, f"{at}.{k}"[:120]))
        elif isinstance(o, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(o))
    return None


def parse_client_json(raw: bytes):
    """A client's JSON that can be stored and sent on: UTF-8, nested at most as deep as the parser
    goes, no lone surrogate in a string (``\\ud800``: no UTF-8 form, so no Parquet or upstream body
    could hold it; looked for only when the raw body has such an escape), and top-level integers of
    at most 20 digits, so no later float() of a client value (sampling parameters, a reward) can
    overflow. Checked after a plain parse: a hook per integer made parsing a long token-id prompt 5x
    slower."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"the request body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise ProtocolError("the JSON body is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate(body)) is not None:
        raise ProtocolError(f"a string at {where} holds a lone UTF-16 surrogate (no UTF-8 form)")
    if isinstance(body, dict):
        for v in body.values():
            if type(v) is int and not -_INT_BOUND < v < _INT_BOUND:
                raise ProtocolError(f"an integer of {len(str(abs(v)))} digits in the request body: "
                                    f"at most {MAX_INT_DIGITS}")
    return body


def upstream_unavailable(exc: Exception, stats: Stats, headers: dict | None = None) -> JSONResponse:
    """No answer from the upstream: a timeout is a 504, anything else a 502 (credentials redacted)."""
    if isinstance(exc, asyncio.TimeoutError):
        return err("the upstream server timed out", 504, stats, "upstream_timeouts", headers)
    if isinstance(exc, NoDeploymentYet):  # the recorder is up before the first policy: say what to do
        return err(str(exc), 503, stats, "no_deployment_yet", headers)
    return err(f"the upstream server is unreachable: {redact(str(exc))}", 502, stats, "upstream_unreachable", headers)


def upstream_error(status: int, content: bytes, ctype: str | None, headers: dict, stats: Stats) -> Response:
    """The upstream's error answer, relayed as it is when it is a JSON error (vLLM's), else as a JSON
    error naming the upstream: its status when it refused the request (4xx), 502 when it failed."""
    stats.inc("upstream_errors")
    try:
        if (ctype or "").startswith("application/json") and isinstance(json.loads(content), dict):
            return Response(content, status_code=status, headers=headers, media_type=ctype)
    except ValueError:
        pass
    text = content[:200].decode("utf-8", errors="replace").strip()
    if 400 <= status < 500:
        return err(f"the upstream server refused the request ({status}): {text}", status, headers=headers)
    return err(f"the upstream server failed ({status}): {text}", 502, headers=headers)


async def read_call_body(request: Request) -> tuple[dict, bytes]:
    raw = await read_body(request, request.app.state.recorder.cfg.max_body_bytes)
    body = parse_client_json(raw)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    return body, raw


# Where a call's trajectory id comes from, highest priority first: the client's own trajectory header,
# a session header, the session of a session-scoped base URL (``OpenAI(base_url=".../s/run-42/v1")``),
# so that one agent run is one trajectory without patching its SDK. The first source present decides;
# every source present must be a valid id (else a 400 naming it: a misconfigured base URL fails on its
# first call, whatever headers come with it); with none, the call starts a trajectory of its own under
# a generated id. ``/stats`` counts ``session_source_<name>`` (``none``: generated).
SESSION_SOURCES = {
    "trajectory_header": "X-Trajectory-Id",
    "session_header": "X-Session-Id",
    "session_url": "the session of the URL /s/<session>/v1/...",
}
SESSION_PARAM = "session"  # the path parameter of the session-scoped routes
_ID_RULE = "1-256 characters of [A-Za-z0-9._:@/+=-]"


def _checked(source: str, value: str | None) -> str | None:
    if value is not None and not _TRAJECTORY_ID.match(value):
        rule = _ID_RULE.replace("/", "") + " (no '/' in a URL)" if source == "session_url" else _ID_RULE
        raise ProtocolError(f"{SESSION_SOURCES[source]} must be {rule}, got {clip(value)}")
    return value


def url_session(request: Request) -> str | None:
    """The session of a ``/s/<session>/v1/...`` route (None on the plain routes), checked."""
    return _checked("session_url", request.path_params.get(SESSION_PARAM))


def session_of(request: Request) -> tuple[str, str]:
    """(trajectory id, source): the first of ``SESSION_SOURCES`` the call carries, else a generated id
    (source ``none``); a ``ProtocolError`` (400) naming the source of a value that is not a valid id."""
    values = {"trajectory_header": _checked("trajectory_header", request.headers.get("x-trajectory-id")),
              "session_header": _checked("session_header", request.headers.get("x-session-id")),
              "session_url": url_session(request)}
    for source, value in values.items():
        if value is not None:
            return value, source
    return uuid.uuid4().hex, "none"


def trajectory_id_of(request: Request) -> str:
    return session_of(request)[0]


def attempt_of(request: Request, raw: bytes) -> Attempt | None:
    """The call's identity across client retries: its ``Idempotency-Key``, else (clients that count
    their retries, like the openai client's ``x-stainless-retry-count``) the body's digest."""
    key = request.headers.get("idempotency-key")
    if key is not None:
        if not 1 <= len(key) <= 256:
            raise ProtocolError("Idempotency-Key must be 1-256 characters")
        return Attempt("key:" + key, retry=True)
    count = request.headers.get("x-stainless-retry-count")
    if count is None:
        return None
    if not (count.isascii() and count.isdigit()) or len(count) > 6:  # isdigit alone takes "¹", which int() refuses
        raise ProtocolError(f"x-stainless-retry-count must be a small non-negative integer, got {clip(count)}")
    return Attempt("body:" + hashlib.blake2b(raw, digest_size=16).hexdigest(), retry=int(count) > 0)


@dataclass
class Caller:
    """Who made a call and which trajectory it goes to: the client's id, and the stored one (under
    its tenant's namespace)."""

    tenant: Tenant
    client_tid: str
    tid: str
    attempt: Attempt | None = None


def tenant_of(request: Request) -> Tenant:
    return request.scope["prodrl.tenant"]


def n_up(up: dict, kind: str) -> int | None:
    n = up.get("logprobs") if kind == "completion" else up.get("top_logprobs")
    return int(n) if is_json_int(n) else None


