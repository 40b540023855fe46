"""A managed server's record and its process: alive, stopped, found again.

A server of a managed target (``servers``) is a process in a session of its own on this machine, or
one that a Ray actor owns on a node (``ray_placement``); ``<state dir>/current.json`` (and
``pending.json`` during a switch) records it as a ``ServerRecord``, so a later process finds,
checks and stops it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import read_json
from prodrl_pipelines.deploy_targets.processes import tail


def pid_alive(pid: int) -> bool:
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


def stop_process_group(pid: int, grace_s: float = 20.0) -> None:
    """TERM the server's session (its own process group), KILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
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
            if not pid_alive(pid):
                return
            time.sleep(0.1)


def record_alive(raw: dict) -> bool:
    """Whether the server a record (or a switch's slot) names still runs: its process here, or its
    actor's process on a Ray node."""
    if raw.get("actor"):
        from prodrl_pipelines.deploy_targets import ray_placement

        return ray_placement.alive(raw["actor"], raw.get("ray_address", ""))
    return pid_alive(int(raw["pid"]))


def stop_record(raw: dict, grace_s: float = 20.0) -> None:
    """Drain and stop the server a record names (a Ray actor: its server, then the actor itself):
    SIGTERM, SIGKILL after ``grace_s``."""
    if raw.get("actor"):
        from prodrl_pipelines.deploy_targets import ray_placement

        ray_placement.stop(raw["actor"], raw.get("ray_address", ""), grace_s=grace_s)
    else:
        stop_process_group(int(raw["pid"]), grace_s=grace_s)


def stop_recorded(state_dir: Path) -> list[str]:
    """Stop the servers a state directory records (pending, then current) and forget them; the
    versions that were still running."""
    stopped = []
    for name in ("pending.json", "current.json"):
        raw = read_json(state_dir / name)
        if raw and record_alive(raw):
            stop_record(raw)
            stopped.append(raw["policy_version"])
        elif raw and raw.get("actor"):
            stop_record(raw)  # an actor whose server died: the actor and its placement group go too
        (state_dir / name).unlink(missing_ok=True)
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

    def alive(self) -> bool:
        return record_alive(asdict(self))

    def log_tail(self) -> str:
        if self.actor:
            from prodrl_pipelines.deploy_targets import ray_placement

            return ray_placement.log_tail(self.actor, self.ray_address)
        return tail(Path(self.log))

    def slot(self, slot, previous: "ServerRecord | None") -> dict:
        """What a switch keeps of the new server of ``slot`` (enough to commit, roll back or stop it)."""
        return {"slot": slot, "pid": self.pid, "port": self.port, "url": self.url, "log": self.log,
                "actor": self.actor, "ray_address": self.ray_address,
                "previous": asdict(previous) if previous else None}


def same_server(a: dict, b: dict) -> bool:
    """Whether two records name one server: by its actor on Ray (whose server's pid changes when the
    actor brings it back), else by pid."""
    if a.get("actor") or b.get("actor"):
        return a.get("actor", "") == b.get("actor", "")
    return int(a["pid"]) == int(b["pid"])


def blue_green_port(raw: dict) -> int:
    """The blue/green port a server holds (on Ray: the one its actor is named after; the node may
    have given it another)."""
    return int(raw["actor"].rsplit("-", 1)[1]) if raw.get("actor") else int(raw["port"])
