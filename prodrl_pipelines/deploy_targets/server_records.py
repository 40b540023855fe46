"""A managed server's record and its process: alive, stopped, found again.

A server of a managed target (``servers``) is a process in a session of its own on this machine, or
one that a Ray actor owns on a node (``ray_placement``); ``<state dir>/current.json`` (and
``pending.json`` during a switch) records it as a ``ServerRecord``, so a later process finds,
checks and stops it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prodrl_pipelines.deploy_targets.processes import tail

log = logging.getLogger(__name__)


def process_start(pid: int) -> int | None:
    """When the process ``pid`` started (clock ticks since boot), or None when none has that pid:
    with the pid it names one process, where the pid alone may name another once the kernel hands it
    out again (a busy machine goes round 32768 pids in minutes: threads take them too)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int, started: int = 0) -> bool:
    """Whether ``pid`` runs (a zombie does not); with ``started`` (``process_start``), whether that
    very process still does."""
    if started and process_start(pid) != started:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not serving
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def stop_process_group(pid: int, grace_s: float = 20.0, started: int = 0) -> None:
    """TERM the server's session (its own process group), KILL what is left after ``grace_s``, and
    return once the leader is gone (a killed process with gigabytes mapped takes a while to go on a
    loaded machine). With ``started``, a pid that now names another process is left alone."""
    if started and process_start(pid) != started:  # a zombie still has its start time
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 120.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
            except ChildProcessError:
                pass
            if not pid_alive(pid, started):
                return
            time.sleep(0.1)
    # not an error to raise: the switch it ends has already happened; whoever checks it sees it alive
    log.warning("process %d outlived SIGKILL by 120 s (stuck in the kernel?)", pid)


def record_alive(raw: dict) -> bool:
    """Whether the server a record (or a switch's slot) names still runs: its process here, or its
    actor's process on a Ray node."""
    if raw.get("actor"):
        from prodrl_pipelines.deploy_targets import ray_placement

        return ray_placement.alive(raw["actor"], raw.get("ray_address", ""))
    return pid_alive(int(raw["pid"]), int(raw.get("pid_start") or 0))


def stop_record(raw: dict, grace_s: float = 20.0) -> None:
    """Drain and stop the server a record names (a Ray actor: its server, then the actor itself):
    SIGTERM, SIGKILL after ``grace_s``."""
    if raw.get("actor"):
        from prodrl_pipelines.deploy_targets import ray_placement

        ray_placement.stop(raw["actor"], raw.get("ray_address", ""), grace_s=grace_s)
    else:
        stop_process_group(int(raw["pid"]), grace_s=grace_s, started=int(raw.get("pid_start") or 0))


def stop_recorded(slots, slot) -> list[str]:
    """Stop the servers a slot records (pending, then current: ``slot_state``) and forget them; the
    versions that were still running."""
    stopped = []
    for kind in ("pending", "current"):
        raw = slots.read(slot, kind)
        if raw and record_alive(raw):
            stop_record(raw)
            stopped.append(raw["policy_version"])
        elif raw and raw.get("actor"):
            stop_record(raw)  # an actor whose server died: the actor and its placement group go too
        slots.drop(slot, kind)
    return stopped


@dataclass
class ServerRecord:
    pid: int
    port: int
    url: str
    policy_version: str
    export_dir: str
    log: str
    started_at: float
    # replica_placement ray: the node (id, address) and the actor that owns the server, and the
    # cluster's GCS address (whoever reads the record reaches the actor)
    node: str = ""
    host: str = ""
    actor: str = ""
    ray_address: str = ""
    pid_start: int = 0  # ``process_start(pid)`` of a server here: the pid alone may name another process later
    # an adapter target's server (``adapters``): the policy version of the base export it runs, and the
    # adapters loaded into it, oldest first (``policy_version`` is the one routed to)
    base_version: str = ""
    adapters: list = field(default_factory=list)

    def alive(self) -> bool:
        return record_alive(asdict(self))

    def log_tail(self) -> str:
        if self.actor:
            from prodrl_pipelines.deploy_targets import ray_placement

            return ray_placement.log_tail(self.actor, self.ray_address)
        return tail(Path(self.log))

    def slot(self, slot, previous: "ServerRecord | None") -> dict:
        """What a switch keeps of the new server of ``slot`` (enough to commit, roll back or stop it)."""
        return {"slot": slot, "pid": self.pid, "pid_start": self.pid_start, "port": self.port, "url": self.url, "log": self.log,
                "actor": self.actor, "ray_address": self.ray_address,
                "previous": asdict(previous) if previous else None}


def same_server(a: dict, b: dict) -> bool:
    """Whether two records name one server: by its actor on Ray (whose server's pid changes when the
    actor brings it back), else by pid (and start time, where both know it)."""
    if a.get("actor") or b.get("actor"):
        return a.get("actor", "") == b.get("actor", "")
    starts = (int(a.get("pid_start") or 0), int(b.get("pid_start") or 0))
    return int(a["pid"]) == int(b["pid"]) and (0 in starts or starts[0] == starts[1])


def blue_green_port(raw: dict) -> int:
    """The blue/green port a server holds (on Ray: the one its actor is named after; the node may
    have given it another)."""
    return int(raw["actor"].rsplit("-", 1)[1]) if raw.get("actor") else int(raw["port"])
