"""What one request to the recorder did, gathered while it runs, for its metrics and its log line.

``observability.asgi.RequestObserver`` (outermost in the recorder's app: 401s and 429s count too)
makes a ``RequestContext`` the current one (``CURRENT``) for each HTTP request: the handler, the
streaming task it starts and the recorder's upstream and commit code all see the same object. Deep
code fills in what only it knows (``upstream_started`` / ``upstream_done``: the replica and how long
the upstream took; ``note_record``: the trajectory, the served version, the token counts), and when
the response has gone out the context goes to ``RecorderMetrics.observe`` and to the request log.

The recorder's own added latency is the request's time minus the upstream's: request in -> upstream
out, plus upstream done -> response out (the WAL commit included, as a client waits for it).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass

from prodrl_pipelines.observability.asgi import ObservedRequest

# the API routes by their plain path: a session-scoped base URL (/s/<session>/v1/...) is the same route
API_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                        "/v1/messages/count_tokens", "/v1/models", "/v1/feedback"})
OTHER_ROUTES = frozenset({"/stats", "/metrics", "/health", "/health/live", "/health/ready"})


def route_of(path: str) -> str:
    """A bounded route label: an API route, a service route, or ``other`` (404s, fuzz)."""
    if path.startswith("/s/"):
        _, _, rest = path[3:].partition("/")
        path = "/" + rest
    return path if path in API_ROUTES or path in OTHER_ROUTES else "other"


@dataclass(slots=True)
class RequestContext(ObservedRequest):
    route: str = "other"
    method: str = ""
    tenant: str | None = None
    upstream_t0: float | None = None
    upstream_s: float | None = None
    replica: str | None = None
    trajectory_id: str | None = None
    version: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @classmethod
    def of(cls, scope) -> "RequestContext":
        return cls(route=route_of(scope.get("path", "")), method=scope.get("method", ""))

    @property
    def added_s(self) -> float | None:
        """The recorder's own share, where the request reached an upstream."""
        return None if self.upstream_s is None else max(self.duration_s - self.upstream_s, 0.0)


CURRENT: ContextVar[RequestContext | None] = ContextVar("prodrl_recorder_request", default=None)


def upstream_started() -> None:
    """The first POST to the upstream is about to go out (retries stay in the same span)."""
    ctx = CURRENT.get()
    if ctx is not None and ctx.upstream_t0 is None:
        ctx.upstream_t0 = time.perf_counter()


def upstream_done(replica: str | None) -> None:
    """The upstream's answer is read whole (or its stream ended): its time, for the replica's histogram."""
    ctx = CURRENT.get()
    if ctx is not None and ctx.upstream_t0 is not None:
        ctx.upstream_s = time.perf_counter() - ctx.upstream_t0
        ctx.replica = replica


def note_record(trajectory_id: str, row: dict | None) -> None:
    """The call was committed: its stored trajectory id and, when recorded, its version and tokens."""
    ctx = CURRENT.get()
    if ctx is None:
        return
    ctx.trajectory_id = trajectory_id
    if row is not None:
        ctx.version = row.get("policy_version")
        ctx.prompt_tokens = len(row.get("prompt_token_ids") or ())
        ctx.completion_tokens = len(row.get("output_token_ids") or ())
