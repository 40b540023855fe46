"""Child processes of the stack: each in a session of its own, logged to a file, stopped as a group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def port_free(port: int) -> bool:
    with socket.socket() as s:
        # as the servers bind: connections of a stopped server in TIME_WAIT do not block the port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pick_port(preferred: int = 0) -> int:
    """``preferred`` when it is free on loopback, else any free port (0: any free port)."""
    if preferred and port_free(preferred):
        return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_port_range(span: int, preferred: int = 0) -> int:
    """A first port whose ``span`` consecutive ports are free on loopback (``preferred`` when they
    are): a fleet's replicas take two ports each."""
    import random

    def free(base: int) -> bool:
        return all(port_free(base + i) for i in range(span))

    if preferred and free(preferred):
        return preferred
    # below the kernel's ephemeral range: a client connection's local port there would take a
    # replica's port later (bind: address already in use)
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(10000, max(10001, low - span))
        if free(base):
            return base
    raise RuntimeError(f"no {span} consecutive free ports on loopback")


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class ManagedProcess:
    """One service: started in its own session (so a TERM to its group reaches its children, and a
    Ctrl-C in the terminal reaches only the stack, which then stops it in order)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, cwd: Path | None = None) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd,
                                         start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_http(self, url: str, timeout_s: float = 120, headers: dict | None = None, cancel=None) -> None:
        """Block until ``url`` answers 200; fail with the log's tail if the process exits first
        (or when the ``cancel`` event is set)."""
        deadline = time.monotonic() + timeout_s
        req = urllib.request.Request(url, headers=headers or {})
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise RuntimeError(f"stopped while waiting for {self.name}")
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; last log lines "
                                   f"({self.log}):\n{tail(self.log)}")
            try:
                urllib.request.urlopen(req, timeout=2).read()
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not answer at {url} within {timeout_s:.0f}s; log ({self.log}):\n"
                           f"{tail(self.log)}")

    def terminate(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait_or_kill(self, timeout_s: float) -> None:
        """Wait for the process; past ``timeout_s`` KILL its whole group. Leftover group members
        (a child that outlived its parent) are killed too."""
        try:
            self.proc.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            self._killpg(signal.SIGKILL)
            self.proc.wait()
        self._killpg(signal.SIGKILL)  # orphans left in the group, if any

    def _killpg(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout_s: float = 30) -> None:
        self.terminate()
        self.wait_or_kill(timeout_s)


def stop_all(procs: list[ManagedProcess], timeout_s: float = 30) -> None:
    """TERM every process at once, then wait for each (KILL past the shared deadline)."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.wait_or_kill(deadline - time.monotonic())
