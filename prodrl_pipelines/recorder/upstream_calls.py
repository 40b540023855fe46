"""Calls to the upstream: a POST to the fixed base URL or to the balancer's replica of the followed
deployment, retried where nothing can have been recorded or relayed yet (a refused connection, a
reset before any answer, an answer cut mid-body). A mixin of ``Recorder``: it reads the recorder's
``http`` session, ``deployment``, ``balancer``, ``stats`` and ``cfg``."""

from __future__ import annotations

import aiohttp

from prodrl_pipelines.recorder.balancer import NoDeploymentYet
from prodrl_pipelines.recorder.calls import dumps
from prodrl_pipelines.recorder.request_context import upstream_done, upstream_started

_JSON = {"Content-Type": "application/json"}
_RESET_ERRORS = tuple(e for e in (getattr(aiohttp, "ServerDisconnectedError", None), getattr(aiohttp, "ClientOSError", None),
                                  getattr(aiohttp, "ClientConnectionResetError", None)) if e is not None)


class UpstreamCalls:
    async def read_upstream(self, path: str, up: dict, trajectory_id: str | None = None) -> tuple[int, str | None, bytes]:
        """``post_upstream`` with the whole answer read: ``(status, content type, body)``. An answer
        cut before its end (its replica killed mid-answer, its node gone) has reached no client and
        is recorded nowhere, so it is asked again: of another replica where there is one (each other
        replica once), else once of the same upstream."""
        avoid: set[str] = set()
        cuts = 0
        while True:
            resp, replica = await self.post_upstream(path, up, trajectory_id, avoid=frozenset(avoid))
            try:
                async with resp:
                    return resp.status, resp.headers.get("content-type"), await resp.read()
            except (aiohttp.ClientPayloadError, *_RESET_ERRORS):
                cuts += 1
                replicas = len(ep.replica_list()) if self.deployment is not None and (ep := self.deployment.current()) else 1
                if cuts > max(1, replicas - 1):
                    raise
                self.stats.inc("upstream_retries")
                if replica is not None and replicas > 1:
                    avoid.add(replica.url)
            finally:
                self.finished(replica)

    async def post_upstream(self, path: str, up: dict, trajectory_id: str | None = None,
                            timeout: aiohttp.ClientTimeout | None = None, avoid: frozenset[str] = frozenset()):
        """POST ``up`` to the upstream: ``(response, replica)``; the response is not read yet (use it
        as ``async with`` or release it), then call ``finished(replica)``.

        With ``--follow`` the replica is the balancer's pick for ``trajectory_id`` (least requests in
        flight among the healthy replicas of its group, the canary's or the stable one), and the body
        names the model that replica serves. A replica that refuses the connection, or does not accept
        it within the connect timeout (a partition), is taken out and the call goes to the next one; a connection closed before any answer came back (a keep-alive
        connection the upstream was closing, a replica draining or killed) is retried on each other
        replica once (once in all with one replica): several replicas can die together (a node).
        Safe for the records: nothing is recorded before an answer. ``avoid``: replicas not to pick
        (one that cut its last answer short).
        """
        assert self.http is not None
        kw = {"timeout": timeout} if timeout is not None else {}
        upstream_started()
        if self.deployment is None:
            data = dumps(up)
            try:
                return await self.http.post(path, data=data, headers=_JSON, **kw), None
            except _RESET_ERRORS as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):  # could not connect at all: no retry
                    raise
                self.stats.inc("upstream_retries")
                return await self.http.post(path, data=data, headers=_JSON, **kw), None
        refused: set[str] = set(avoid)
        resets = 0
        while True:
            ep = self.deployment.current()
            if ep is None:
                raise NoDeploymentYet(f"no policy is live yet ({self.cfg.follow} does not exist): launch the "
                                      "`bootstrap` job in Dagster (or run `prodrl bootstrap`), then call again")
            choice = self.balancer.pick(ep, trajectory_id, frozenset(refused))
            if choice is None:
                raise aiohttp.ClientConnectionError(f"no replica of the deployment accepts connections "
                                                    f"(tried {sorted(refused)})")
            if choice.served_model_name:
                up["model"] = choice.served_model_name
            self.balancer.started(choice)
            try:
                resp = await self.http.post(choice.url.rstrip("/") + "/" + path, data=dumps(up),
                                            headers=_JSON, **kw)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                # refused, or no connection within the connect timeout (a partition drops packets):
                # nothing was sent, so the call goes to another replica
                self.balancer.finished(choice)
                if self.balancer.refused(choice, exc):
                    self.stats.inc("canary_paused")
                refused.add(choice.url)
                self.stats.inc("upstream_replica_refused" if isinstance(exc, aiohttp.ClientConnectorError)
                               else "upstream_connect_timeouts")
                continue
            except _RESET_ERRORS:
                self.balancer.finished(choice)
                resets += 1
                self.stats.inc("upstream_retries")
                if resets > max(1, len(ep.replica_list()) - 1):
                    raise
                if len(ep.replica_list()) > 1:
                    refused.add(choice.url)
                continue
            except BaseException:
                self.balancer.finished(choice)
                raise
            return resp, choice

    def finished(self, choice) -> None:
        """The call on ``choice`` (from ``post_upstream``) has ended: its answer read or its stream
        over (the upstream's time for the request's metrics and log line ends here)."""
        upstream_done(choice.url if choice is not None else None)
        if choice is not None:
            self.balancer.finished(choice)

    def upstream_url(self, path: str) -> str:
        """``path`` on the upstream: relative to the fixed base URL, or on a replica of the followed
        deployment (for reads such as ``/v1/models``)."""
        if self.deployment is None:
            return path
        ep = self.deployment.current()
        if ep is None:
            raise NoDeploymentYet(f"no policy is live yet ({self.cfg.follow} does not exist): launch the "
                                  "`bootstrap` job in Dagster (or run `prodrl bootstrap`)")
        choice = self.balancer.pick(ep, None)
        return choice.url.rstrip("/") + "/" + path
