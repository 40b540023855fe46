"""What a deploy target is: one protocol, its result, and the endpoint file the recorder follows.

A deploy is two-phase so the previous export keeps serving (or stays restorable) until the parity
probe passed (DESIGN.md s.7; vLLM updates are not transactional):

1. ``switch(export_dir, policy_version) -> Switch``: make the export serve and healthy; the
   ``Switch`` says where (``endpoint``, None for ``pointer``) and how long it took;
2. ``commit(switch)`` once the probe passed (the new one becomes *the* deployment: the endpoint
   file is rewritten, an old server is drained and stopped), or ``rollback(switch)`` when it
   failed (the previous export serves again; returns what was done, for the reason tags).

The endpoint file (``<home>/deployment/endpoint.json``) is the deployment's live pointer for the
processes in front of it: ``prodrl record --follow`` re-reads it (URL, served model name, policy
version) when it changes, so the recorder follows a blue/green restart and tags an in-place reload.
Several processes change it (a deploy's waves, the canary's start and stop, a recorder pausing a
canary that refuses connections): every change is a read-modify-write under an exclusive ``flock``
on a lock file beside it (``EndpointFile.update``), so no writer puts back what another removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from prodrl_pipelines.storage.atomic import write_json_atomic
from typing import Protocol


class DeployError(RuntimeError):
    """A deploy that could not make the export serve (the previous deployment is untouched)."""


@dataclass
class Switch:
    target: str
    policy_version: str
    export_dir: str
    endpoint: str | None  # OpenAI-compatible base URL serving it now (None: nothing managed)
    served_model_name: str | None = None
    seconds: float = 0.0  # from "deploy" to healthy
    previous: dict | None = None  # what served before (restored by rollback)
    detail: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {"target": self.target, "endpoint": self.endpoint or "", "switch_seconds": round(self.seconds, 3),
                **{k: v for k, v in self.detail.items() if isinstance(v, (str, int, float, bool))}}


class DeployTarget(Protocol):
    name: str

    def switch(self, export_dir: Path, policy_version: str) -> Switch: ...

    def commit(self, switch: Switch) -> None: ...

    def rollback(self, switch: Switch) -> str: ...


def write_json(path: Path, obj: dict) -> None:
    """Atomically (readers never see half a file), durable before the rename."""
    write_json_atomic(path, obj, indent=2)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


@dataclass
class Endpoint:
    """What the deployment serves now, as the processes in front of it see it.

    ``url`` / ``served_model_name`` / ``policy_version`` name the deployment (a fleet: its first
    replica and the version it rolls out); ``replicas`` lists every server behind it (``url``,
    ``served_model_name``, ``policy_version`` each: versions differ during a rolling update), empty
    for one server; ``canary``, while a candidate is tried on live traffic, holds its ``fraction``
    of trajectories, its ``policy_version`` and its ``replicas``.
    """

    url: str
    served_model_name: str
    policy_version: str
    target: str = ""
    export_dir: str = ""  # what it serves (a rollback of an in-place reload reloads it)
    switched_at: str = ""
    replicas: list[dict] = field(default_factory=list)
    canary: dict | None = None

    def replica_list(self) -> list[dict]:
        """The servers behind the stable address (one: the deployment itself)."""
        return self.replicas or [{"url": self.url, "served_model_name": self.served_model_name,
                                  "policy_version": self.policy_version}]

    def canary_paused(self) -> str | None:
        """Why the running canary was taken off traffic (its server refused connections), else None."""
        paused = (self.canary or {}).get("paused")
        return str(paused.get("reason", "paused")) if isinstance(paused, dict) else None

    def canary_paused_at(self) -> datetime | None:
        """When the running canary was paused (None: it is not)."""
        paused = (self.canary or {}).get("paused")
        try:
            return datetime.fromisoformat(paused["at"]) if isinstance(paused, dict) else None
        except (KeyError, TypeError, ValueError):
            return datetime.fromtimestamp(0, timezone.utc)  # paused, time unknown: as long ago as can be

    def version_of(self, served_model_name: str | None) -> str | None:
        """The policy version a server answering as ``served_model_name`` serves (None: not listed)."""
        for r in self.replica_list() + list((self.canary or {}).get("replicas", [])):
            if r["served_model_name"] == served_model_name:
                return r["policy_version"]
        return None


class EndpointFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def locked(self):
        """Exclusive over every process and thread that changes the file (``flock`` on a sibling lock
        file: one open file description per holder, so threads of one process exclude each other too).
        Readers need no lock: the file is replaced atomically."""
        lock = self.path.with_name(self.path.name + ".lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _write(self, ep: Endpoint) -> None:
        ep.switched_at = ep.switched_at or datetime.now(timezone.utc).isoformat()
        write_json(self.path, asdict(ep))

    def write(self, ep: Endpoint) -> None:
        """Replace the whole file (what a target that owns it outright writes)."""
        with self.locked():
            self._write(ep)

    def update(self, change) -> Endpoint | None:
        """Read, ``change(endpoint or None)`` -> the endpoint to write (None: leave the file as it is),
        write: one step under the lock. Returns what the file holds afterwards."""
        with self.locked():
            new = change(self.read())
            if new is None:
                return self.read()
            self._write(new)
            return new

    def pause_canary(self, url: str, policy_version: str, reason: str) -> bool:
        """Take the canary serving ``policy_version`` at ``url`` off traffic and record why (its
        trajectories go to the stable replicas; whoever judges the canary reads ``canary_paused()``).
        False when that canary is no longer listed (stopped or replaced meanwhile) or already paused."""
        done = []

        def change(ep):
            can = ep.canary if ep is not None else None
            if not can or can.get("policy_version") != policy_version or can.get("paused") \
                    or url not in [r.get("url") for r in can.get("replicas", [])]:
                return None
            can["paused"] = {"reason": reason, "url": url, "at": datetime.now(timezone.utc).isoformat()}
            done.append(True)
            return ep

        self.update(change)
        return bool(done)

    def resume_canary(self, url: str, policy_version: str) -> bool:
        """Put the paused canary serving ``policy_version`` at ``url`` back on traffic (its server
        answers again: Ray or its actor restarted it); the pause is kept in ``canary["pauses"]``.
        False when that canary is not listed paused."""
        done = []

        def change(ep):
            can = ep.canary if ep is not None else None
            paused = (can or {}).get("paused")
            if not paused or can.get("policy_version") != policy_version \
                    or url not in [r.get("url") for r in can.get("replicas", [])]:  # its URL may have moved
                return None
            can.setdefault("pauses", []).append({**paused, "resumed_at": datetime.now(timezone.utc).isoformat()})
            can["paused"] = None
            done.append(True)
            return ep

        self.update(change)
        return bool(done)

    def read(self) -> Endpoint | None:
        raw = read_json(self.path)
        if not raw:
            return None
        return Endpoint(**{k: v for k, v in raw.items() if k in Endpoint.__dataclass_fields__})


class KeyRefused(DeployError):
    """A server answered 401/403: the key sent (or its absence) is not the one it requires."""


def _get(url: str, timeout: float, api_key: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def served_models(url: str, api_key: str | None = None, timeout: float = 5.0) -> list[str]:
    status, body = _get(url.rstrip("/") + "/v1/models", timeout, api_key)
    if status in (401, 403):  # no waiting makes a key right
        raise KeyRefused(f"GET {url}/v1/models -> HTTP {status} "
                         f"({'no key sent' if not api_key else 'the key sent was refused'}): the server requires "
                         "the deployment's key (PRODRL_DEPLOY_API_KEY / VLLM_API_KEY)")
    if status != 200:
        raise DeployError(f"GET {url}/v1/models -> HTTP {status}: {body[:200]!r}")
    return [str(m["id"]) for m in json.loads(body).get("data") or []]


def wait_healthy(url: str, timeout_s: float, *, expect_model: str | None = None, api_key: str | None = None,
                 alive=None, log_tail=None) -> float:
    """Block until ``url``'s ``/health`` is 200 (and ``/v1/models`` lists ``expect_model``); the
    seconds waited. ``alive()`` False (the server process died) or the timeout fail with the log."""
    t0 = time.monotonic()
    last = "no answer"
    while True:
        if alive is not None and not alive():
            raise DeployError(f"the server for {url} exited before it was healthy"
                              + (f"; its log ends:\n{log_tail()}" if log_tail else ""))
        try:
            status, _ = _get(url.rstrip("/") + "/health", 5.0, api_key)
            if status == 200:
                if expect_model is None:
                    return time.monotonic() - t0
                names = served_models(url, api_key)
                if expect_model in names:
                    return time.monotonic() - t0
                last = f"serves {names}, not {expect_model!r}"
            else:
                last = f"/health -> HTTP {status}"
        except KeyRefused:
            raise
        except (OSError, DeployError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() - t0 > timeout_s:
            raise DeployError(f"{url} was not healthy within {timeout_s:.0f}s (last: {last})"
                              + (f"; its log ends:\n{log_tail()}" if log_tail else ""))
        time.sleep(0.25)


def is_moe(export_dir: Path) -> bool:
    """Whether the export is a mixture-of-experts model (its config names experts or a *Moe* class);
    False when it has no readable config (the server that is given it reports that)."""
    try:
        cfg = json.loads((Path(export_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts")
                or any("Moe" in a for a in cfg.get("architectures") or []))
