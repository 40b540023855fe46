"""One JSON line per API request (``prodrl record --request-log PATH``, ``-`` for standard output).

A line holds what an operator greps and joins on, never a prompt or an output:
``{"ts", "level", "service": "recorder", "event": "request", "method", "route", "status", "tenant",
"trajectory_id", "version", "replica", "streamed", "duration_ms", "upstream_ms", "added_ms",
"prompt_tokens", "completion_tokens"}`` (a field the request never reached is null: a 401 has no
tenant, a refused call no replica). Probes and scrapes (``/health*``, ``/metrics``, ``/stats``) are
not logged: a kubelet would fill the log. The same line shape as ``observability.json_logs`` gives the
services' other events.
"""

from __future__ import annotations

import json
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

from prodrl_pipelines.recorder.request_context import API_ROUTES, RequestContext


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def request_line(ctx: RequestContext) -> dict:
    return {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "level": "info",
            "service": "recorder", "event": "request", "method": ctx.method, "route": ctx.route,
            "status": ctx.status, "tenant": ctx.tenant, "trajectory_id": ctx.trajectory_id,
            "version": ctx.version, "replica": ctx.replica, "streamed": ctx.streamed,
            "duration_ms": _ms(ctx.duration_s), "upstream_ms": _ms(ctx.upstream_s), "added_ms": _ms(ctx.added_s),
            "prompt_tokens": ctx.prompt_tokens, "completion_tokens": ctx.completion_tokens}


class RequestLog:
    """Appends a line per API request to a file (line-buffered: a crash loses at most the line being
    written) or to standard output."""

    def __init__(self, target: str) -> None:
        self.target = target
        if target == "-":
            self._fh, self._owned = sys.stdout, False
        else:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            self._fh, self._owned = open(target, "a", buffering=1, encoding="utf-8"), True
        self._lock = threading.Lock()

    def write(self, ctx: RequestContext) -> None:
        if ctx.route not in API_ROUTES:
            return
        line = json.dumps(request_line(ctx), separators=(",", ":")) + "\n"
        with self._lock:
            self._fh.write(line)
            if not self._owned:
                self._fh.flush()

    def close(self) -> None:
        if self._owned:
            self._fh.close()
