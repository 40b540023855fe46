"""One ASGI middleware that times requests, for the recorder's and ``prodrl serve``'s metrics.

``RequestObserver(app, begin, done, current)``: for each HTTP request ``begin(scope)`` gives the
request's record (an ``ObservedRequest``; None: the request is not observed), made the value of the
context variable ``current`` while the request runs (the handler, the streaming task it starts and
the code below them see the same object and fill in what only they know); its status and whether
its body was streamed are noted as they go out, and ``done(record, scope)`` gets it once the response
is sent (or the handler failed: status 500).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(slots=True)
class ObservedRequest:
    t0: float = field(default_factory=time.perf_counter)
    status: int = 0
    end: float = 0.0
    streamed: bool = False

    @property
    def duration_s(self) -> float:
        return self.end - self.t0


class RequestObserver:
    def __init__(self, app, begin, done, current: ContextVar) -> None:
        self.app = app
        self.begin = begin
        self.done = done
        self.current = current

    async def __call__(self, scope, receive, send):
        req = self.begin(scope) if scope["type"] == "http" else None
        if req is None:
            await self.app(scope, receive, send)
            return

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                req.status = message["status"]
            elif message["type"] == "http.response.body" and message.get("more_body"):
                req.streamed = True
            await send(message)

        token = self.current.set(req)
        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self.current.reset(token)
            req.end = time.perf_counter()
            req.status = req.status or 500
            self.done(req, scope)
