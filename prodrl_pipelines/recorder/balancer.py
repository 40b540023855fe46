"""Which replica answers a call: the deployment's replicas as its endpoint file lists them, the
healthy one with the fewest requests in flight, and a canary slice that is sticky per trajectory.

A trajectory goes to the canary when ``canary_share(trajectory_id) < canary.fraction``: a hash of
its id, so every call of an episode is served by the same version (never switching mid-way) and the
slice is a fixed random fraction of trajectories. Calls without a trajectory id go to the stable
replicas. A replica that refuses a connection is taken out for ``down_s`` and its health is checked
(``/health``) before it comes back; when every replica of a group is out, they are all tried (a
replica that is back answers; one that is not fails the call as before).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from dataclasses import dataclass

import aiohttp


class NoDeploymentYet(aiohttp.ClientConnectionError):
    """The followed endpoint file does not exist yet: no policy is live."""


@dataclass(frozen=True)
class Choice:
    url: str
    served_model_name: str
    policy_version: str
    canary: bool = False


def canary_share(trajectory_id: str) -> float:
    """A uniform number in [0, 1) fixed by the trajectory id (the first 8 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(trajectory_id.encode("utf-8")).digest()[:8], "big") / 2.0**64


class Balancer:
    def __init__(self, down_s: float = 2.0, clock=time.monotonic) -> None:
        self.down_s, self.clock = down_s, clock
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()  # rotates ties, so idle replicas share the load

    def groups(self, endpoint) -> tuple[list[Choice], list[Choice], float]:
        """(stable replicas, canary replicas, canary fraction) of an endpoint file's ``Endpoint``."""
        stable = [Choice(r["url"], r["served_model_name"], r["policy_version"]) for r in endpoint.replica_list()]
        canary = endpoint.canary or {}
        picks = [Choice(r["url"], r["served_model_name"], r["policy_version"], True) for r in canary.get("replicas", [])]
        return stable, picks, float(canary.get("fraction", 0.0)) if picks else 0.0

    def pick(self, endpoint, trajectory_id: str | None, exclude: frozenset[str] = frozenset()) -> Choice | None:
        """The replica for the next call of ``trajectory_id`` (None: nothing left to try)."""
        stable, canary, fraction = self.groups(endpoint)
        group = canary if canary and trajectory_id and canary_share(trajectory_id) < fraction else stable
        left = [c for c in group if c.url not in exclude]
        if not left:
            return None
        now = self.clock()
        with self._lock:
            healthy = [c for c in left if self._down_until.get(c.url, 0.0) <= now] or left
            turn = next(self._turn)
            return min(healthy, key=lambda c: (self._outstanding.get(c.url, 0),
                                               (healthy.index(c) - turn) % len(healthy)))

    def started(self, choice: Choice) -> None:
        with self._lock:
            self._outstanding[choice.url] = self._outstanding.get(choice.url, 0) + 1

    def finished(self, choice: Choice) -> None:
        with self._lock:
            self._outstanding[choice.url] = max(0, self._outstanding.get(choice.url, 0) - 1)

    def mark_down(self, url: str) -> None:
        with self._lock:
            self._down_until[url] = self.clock() + self.down_s

    def mark_up(self, url: str) -> None:
        with self._lock:
            self._down_until.pop(url, None)

    def down(self) -> list[str]:
        now = self.clock()
        with self._lock:
            return sorted(u for u, t in self._down_until.items() if t > now)

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outstanding)
