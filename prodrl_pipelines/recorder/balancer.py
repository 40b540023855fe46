"""Which replica answers a call: the deployment's replicas as its endpoint file lists them, the
healthy one with the fewest requests in flight, an episode kept on one policy version while it can
be, and a canary slice of trajectories.

**Stickiness per trajectory.** The version that served a trajectory's latest call is remembered (a
bounded table, least recently used out): its next call goes to a healthy replica serving that
version, stable or canary, while the endpoint file lists one. During a rolling wave an episode that
started on the old version therefore finishes there while an old replica is left (the waves replace
them one by one), and one that started on a new replica stays on new ones. When no healthy replica
of its version is left (the last old one was replaced, or the canary went away) the call goes where a
new trajectory would go and the episode *crosses versions* (counted: ``crossings``); it is pinned to
the version that served it from then on. Selection never trains such an episode as complete.

**A session stays on its replica.** Within its version, a trajectory's next call goes to the replica
that answered its last one (its prompt extends the last call's, whose prefix that replica's KV cache
holds) while that replica is healthy, not excluded, and has at most ``sticky_slack`` more calls in
flight than the least loaded replica it could go to; otherwise it goes to the least loaded one and
is pinned there (counted: ``sticky_moves``). The pins are keyed by the stored trajectory id, which
is scoped to the tenant: two tenants' sessions of the same name never share one. ``sticky=False``
(``prodrl record --no-session-affinity``): every call to the least loaded replica of its version.

**The canary slice.** A trajectory seen for the first time goes to the canary when
``canary_share(trajectory_id) < canary.fraction``: a hash of its id, so the slice is a fixed random
fraction of trajectories. A trajectory that started before the canary did keeps its version (the
pin), so no episode enters the canary half-way. Calls without a trajectory id go to the stable
replicas.

**Failures.** A replica that refuses a connection is taken out for ``down_s`` and its health is
checked (``/health``) before it comes back; the call goes to another replica of its version, else
to any healthy one (a canary's trajectories fall back to the stable replicas: nothing was answered,
so nothing is recorded twice). When every candidate is out they are tried anyway (one that is back
answers). A canary that cannot be connected to ``refusals_to_pause`` times in a row (calls and health
checks) is paused in the endpoint file with the reason (``EndpointFile.pause_canary``): no traffic
goes to it any more, and whoever judges the canary reads ``Endpoint.canary_paused()``; once its
server answers ``/health`` again (Ray restarted it) the recorder's health loop resumes it. The file is
written by a thread of its own: its lock may be held for a while by a deploy, and the recorder's event
loop never waits on it (the balancer sends the canary nothing from the moment it decides).

The table is this process's: with a fleet of recorders, an episode stays on one version when the
load balancer in front sends a trajectory's calls to one recorder (sticky on ``X-Trajectory-Id``);
otherwise each recorder applies the same rules from the call it sees.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import OrderedDict
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
    def __init__(self, down_s: float = 2.0, clock=time.monotonic, *, endpoints=None, max_pins: int = 100_000,
                 refusals_to_pause: int = 3, sticky_slack: int = 4, sticky: bool = True) -> None:
        self.down_s, self.clock, self.sticky_slack, self.sticky = down_s, clock, sticky_slack, sticky
        self.endpoints = endpoints  # the followed EndpointFile: where a canary that refuses is paused
        self.max_pins, self.refusals_to_pause = max_pins, refusals_to_pause
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self._refusals: dict[str, int] = {}  # connection failures in a row, per url
        self._pins: OrderedDict[str, str] = OrderedDict()  # trajectory id -> version of its latest call
        self._replicas: OrderedDict[str, str] = OrderedDict()  # trajectory id -> url of its latest call
        self.sticky_moves = 0  # calls that left their session's replica (down, gone or too loaded)
        self._turn = itertools.count()  # rotates ties, so idle replicas share the load
        self.crossings = 0  # calls that found no replica of their episode's version left
        self.paused: list[str] = []  # canaries this balancer paused: "url: reason"
        self._pausing: set[tuple[str, str]] = set()  # (url, version) whose pause is decided, maybe not yet written
        self._pause_threads: list[threading.Thread] = []

    def groups(self, endpoint) -> tuple[list[Choice], list[Choice], float]:
        """(stable replicas, canary replicas, canary fraction) of an endpoint file's ``Endpoint``; a
        paused canary takes no traffic."""
        stable = [Choice(r["url"], r["served_model_name"], r["policy_version"]) for r in endpoint.replica_list()]
        canary = endpoint.canary or {}
        with self._lock:
            pausing = any((r.get("url"), canary.get("policy_version")) in self._pausing
                          for r in canary.get("replicas", []))
        picks = [] if canary.get("paused") or pausing else [
            Choice(r["url"], r["served_model_name"], r["policy_version"], True) for r in canary.get("replicas", [])]
        return stable, picks, float(canary.get("fraction", 0.0)) if picks else 0.0

    def pick(self, endpoint, trajectory_id: str | None, exclude: frozenset[str] = frozenset()) -> Choice | None:
        """The replica for the next call of ``trajectory_id`` (None: nothing left to try)."""
        stable, canary, fraction = self.groups(endpoint)
        now = self.clock()
        with self._lock:
            pinned = self._pins.get(trajectory_id) if trajectory_id else None
            tiers = []
            if pinned is not None:
                tiers.append([c for c in stable + canary if c.policy_version == pinned])
            elif canary and trajectory_id and canary_share(trajectory_id) < fraction:
                tiers.append(canary)
            tiers.append(stable)
            last_url = self._replicas.get(trajectory_id) if trajectory_id and self.sticky else None
            choice = self._sticky(tiers[0], last_url, exclude, now) if last_url else None
            if choice is None:
                choice = self._choose(tiers, exclude, now)
                if choice is not None and last_url is not None:
                    self.sticky_moves += 1
            if choice is not None and trajectory_id:
                if pinned is not None and choice.policy_version != pinned:
                    self.crossings += 1
                for table, value in ((self._pins, choice.policy_version), (self._replicas, choice.url)):
                    table[trajectory_id] = value
                    table.move_to_end(trajectory_id)
                    while len(table) > self.max_pins:
                        table.popitem(last=False)
            return choice

    def _sticky(self, tier: list[Choice], url: str, exclude: frozenset[str], now: float) -> Choice | None:
        """The session's last replica, if it is in ``tier``, healthy, not excluded, and within
        ``sticky_slack`` calls in flight of the least loaded healthy replica of ``tier``."""
        healthy = [c for c in tier if c.url not in exclude and self._down_until.get(c.url, 0.0) <= now]
        mine = next((c for c in healthy if c.url == url), None)
        if mine is None:
            return None
        least = min(self._outstanding.get(c.url, 0) for c in healthy)
        return mine if self._outstanding.get(url, 0) <= least + self.sticky_slack else None

    def _choose(self, tiers: list[list[Choice]], exclude: frozenset[str], now: float) -> Choice | None:
        """The least loaded healthy replica of the first tier that has one; when none is healthy
        anywhere, the least loaded one not yet tried, in tier order."""
        for healthy_only in (True, False):
            for tier in tiers:
                left = [c for c in tier if c.url not in exclude
                        and (not healthy_only or self._down_until.get(c.url, 0.0) <= now)]
                if left:
                    turn = next(self._turn)
                    return min(left, key=lambda c: (self._outstanding.get(c.url, 0),
                                                     (left.index(c) - turn) % len(left)))
        return None

    def version_of(self, trajectory_id: str) -> str | None:
        """The version the trajectory's latest call was sent to (None: not seen, or forgotten)."""
        with self._lock:
            return self._pins.get(trajectory_id)

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
            self._refusals.pop(url, None)

    def refused(self, choice: Choice, error: BaseException | None = None) -> bool:
        """``choice`` could not be connected to (a call or a health check): taken out for ``down_s``;
        a canary that keeps refusing is paused in the endpoint file (written by a thread: ``settle``).
        True when this call decided the pause (once per canary and version)."""
        self.mark_down(choice.url)
        if not choice.canary:
            return False
        with self._lock:
            n = self._refusals[choice.url] = self._refusals.get(choice.url, 0) + 1
        if n < self.refusals_to_pause or self.endpoints is None:
            return False
        reason = (f"the canary server {choice.url} ({choice.policy_version}) could not be connected to "
                  f"{n} times in a row" + (f" (last: {type(error).__name__}: {error})" if error is not None else "")
                  + "; its trajectories go to the stable replicas")
        key = (choice.url, choice.policy_version)
        with self._lock:  # once per canary: the endpoint file says it is paused from then on
            if key in self._pausing:
                return False
            self._pausing.add(key)
        t = threading.Thread(target=self._pause, args=(choice, reason), daemon=True, name="canary-pause")
        self._pause_threads.append(t)
        t.start()
        return True

    def _pause(self, choice: Choice, reason: str) -> None:
        try:
            if self.endpoints.pause_canary(choice.url, choice.policy_version, reason):
                with self._lock:
                    self.paused.append(f"{choice.url}: {reason}")
        except Exception as e:  # noqa: BLE001 - the file cannot be written: the next refusal tries again
            with self._lock:
                self._pausing.discard((choice.url, choice.policy_version))
                self.paused.append(f"{choice.url}: pause not written ({type(e).__name__}: {e})")

    def paused_canary(self, endpoint) -> list[Choice]:
        """The replicas of a canary the endpoint file lists as paused (the health loop checks them)."""
        canary = endpoint.canary or {}
        if not canary.get("paused"):
            return []
        return [Choice(r["url"], r["served_model_name"], r["policy_version"], True) for r in canary.get("replicas", [])]

    def resumed(self, choice: Choice) -> None:
        """The canary at ``choice`` answers again and was resumed in the endpoint file: back in rotation."""
        with self._lock:
            self._pausing.discard((choice.url, choice.policy_version))
            self._refusals.pop(choice.url, None)
            self._down_until.pop(choice.url, None)

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the pauses decided so far to be written (tests, shutdown)."""
        for t in list(self._pause_threads):
            t.join(timeout_s)

    def down(self) -> list[str]:
        now = self.clock()
        with self._lock:
            return sorted(u for u, t in self._down_until.items() if t > now)

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outstanding)
