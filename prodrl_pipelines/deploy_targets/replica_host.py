"""The Ray actor that owns one replica's server on its node, and keeps it at the slot's live version.

A ``ReplicaHost`` starts its server (``start``), reports where it listens, and supervises it:

- the server exits unasked: the actor starts it again (same port when free there, else another),
  backing off 0.5 s .. 30 s while it keeps exiting;
- the actor's worker dies: Ray restarts the actor (``max_restarts=-1``) and the new one starts the spec
  it finds in the cluster's key-value store (GCS) under its name;
- the node dies: Ray reschedules the actor's placement group where the bundle fits, same as above.

Only the slot's *live* server is brought back: a commit marks it (``live/<slot>`` -> actor name). An
actor that is not live (the pending server of a deploy under way, an old one draining) starts nothing,
so its deploy sees the server gone and rolls back, and a fleet is never recorded at a version it does
not serve. Each (re)start writes ``rec/<actor>`` (node, host, port, pid, url): records are read through
it (``ray_placement.refresh``), and the fleet keeper moves the endpoint file's URL when it changed.

Servers are forked from one long-lived thread with a parent-death signal, so a server cannot outlive
its actor (holding the GPU and the port) when the worker is killed.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time

KV_NAMESPACE = "prodrl-fleet"
BACKOFF_S = (0.5, 30.0)
SUPERVISE_PERIOD_S = 0.5


def kv_put(key: str, value: dict | str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value if isinstance(value, str) else json.dumps(value), namespace=KV_NAMESPACE)


def kv_get(key: str) -> dict | str | None:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(key, namespace=KV_NAMESPACE)
    if raw is None:
        return None
    text = raw.decode()
    return json.loads(text) if text.startswith("{") else text


def kv_del(key: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=KV_NAMESPACE)


def slot_key(actor_name: str) -> str:
    """``<prefix>-<slot>-<port>`` -> ``live/<prefix>-<slot>``: the mark naming the slot's live actor."""
    return "live/" + actor_name.rsplit("-", 1)[0]


def with_address(cmd: list[str], host: str, port: int) -> list[str]:
    """The command line listening on ``host:port`` (``--host`` / ``--port`` replaced)."""
    out = list(cmd)
    for i, a in enumerate(out[:-1]):
        if a == "--host":
            out[i + 1] = host
        elif a == "--port":
            out[i + 1] = str(port)
    return out


def free_port(host: str, preferred: int) -> int:
    """``preferred`` when it is free on ``host``, else one the OS gives."""
    import socket

    for want in (preferred, 0):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                s.bind((host, want))
            except OSError:
                continue
            return s.getsockname()[1]
    return 0


def _die_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Spawner:
    """Forks servers from one thread that lives as long as the actor: a parent-death signal fires when
    the forking *thread* exits, and Ray's method threads are not ours to keep."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="replica-spawner").start()

    def _run(self) -> None:
        import subprocess

        while True:
            cmd, env, log, done = self.jobs.get()
            try:
                with open(log, "ab") as fh:
                    done.put(subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                              start_new_session=True, preexec_fn=_die_with_parent))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                done.put(e)

    def popen(self, cmd: list[str], env: dict, log: str):
        done: queue.Queue = queue.Queue()
        self.jobs.put((cmd, env, log, done))
        out = done.get()
        if isinstance(out, BaseException):
            raise out
        return out


class ReplicaHost:
    """The actor (``ray.remote`` when placed): one server on its node, supervised (module docstring)."""

    def __init__(self, name: str) -> None:
        import ray

        self.name = name
        self.proc = None
        self.spec: dict | None = None  # cmd, env, log, port (preferred), version, export
        self.lock = threading.RLock()
        self.stopping = False
        self.restarts = 0
        self.error = ""
        self.spawner = _Spawner()
        self.verified: dict[str, str] = {}  # export -> this node's copy, verified by ``fetch`` in this life
        ctx = ray.get_runtime_context()
        self.node = ctx.get_node_id()
        self.host = ray.util.get_node_ip_address()
        if ctx.was_current_actor_reconstructed:  # a worker or node died: come back if still live
            spec = kv_get(f"spec/{name}")
            if isinstance(spec, dict) and self.is_live():
                self.spec = spec
                try:
                    self._launch()
                except Exception:  # noqa: BLE001 - the supervisor tries again, backing off
                    self.proc = None
        threading.Thread(target=self._supervise, daemon=True, name="replica-supervisor").start()

    def where(self, preferred_port: int) -> dict:
        """This node (id, address) and a free port on it: ``preferred_port`` when it is free."""
        return {"node": self.node, "host": self.host, "port": free_port(self.host, preferred_port)}

    def is_live(self) -> bool:
        return kv_get(slot_key(self.name)) == self.name

    def fetch(self, export: str, source: dict | None) -> str:
        """This node's verified copy of ``export`` (the path itself when the node sees it, else fetched
        from ``source``'s store): its own call, so a large export gets its own time budget before the
        server starts, and the start after it finds the copy verified."""
        from prodrl_pipelines.deploy_targets.node_exports import locate

        found = locate(export, source)
        self.verified[export] = found
        return found

    def start(self, cmd: list[str], env: dict, log: str, port: int, version: str = "", export: str = "",
              source: dict | None = None) -> int:
        """Start the server (``cmd`` listens on ``port``); its spec is kept in the GCS store so a
        restarted actor can start it again. ``source``: where the export is in the store, when this
        node may not see ``export`` (``node_exports``)."""
        with self.lock:
            self._stop_proc(5.0)
            self.stopping = False
            self.spec = {"cmd": cmd, "env": env, "log": log, "port": port, "version": version, "export": export,
                         "source": source}
            kv_put(f"spec/{self.name}", self.spec)
            return self._launch()

    def _launch(self) -> int:
        spec = self.spec
        os.makedirs(os.path.dirname(spec["log"]), exist_ok=True)
        export = spec.get("export", "")
        if spec.get("source"):  # the node's own copy of the export: the shared path, else fetched
            from prodrl_pipelines.deploy_targets.node_exports import locate

            found = self.verified.get(export, "")
            if not (found and os.path.isdir(found)):
                found = locate(export, spec["source"])
            spec = {**spec, "cmd": [found if a == export else a for a in spec["cmd"]]}
            export = found
        port = free_port(self.host, int(spec["port"]))
        cmd = with_address(spec["cmd"], self.host, port)
        self.proc = self.spawner.popen(cmd, {**os.environ, **spec["env"]}, spec["log"])
        kv_put(f"rec/{self.name}", {"node": self.node, "host": self.host, "port": port, "pid": self.proc.pid,
                                    "url": f"http://{self.host}:{port}", "export": export,
                                    "restarts": self.restarts, "at": time.time()})
        return self.proc.pid

    def _supervise(self) -> None:
        delay = BACKOFF_S[0]
        while True:
            time.sleep(SUPERVISE_PERIOD_S)
            with self.lock:
                if self.stopping or self.spec is None or (self.proc is not None and self.proc.poll() is None):
                    continue
                try:
                    live = self.is_live()
                except Exception:  # noqa: BLE001 - the GCS unreachable for a moment: look again later
                    continue
                if not live:
                    continue
                started = time.monotonic()
                self.restarts += 1
                try:
                    self._launch()
                except Exception as e:  # noqa: BLE001 - an export not fetchable now: try again later
                    self.proc, self.error = None, f"{type(e).__name__}: {e}"
            # a server that keeps exiting is not restarted in a tight loop
            time.sleep(delay)
            with self.lock:
                up = self.proc is not None and self.proc.poll() is None
            delay = BACKOFF_S[0] if up and time.monotonic() - started > 2 * delay else min(2 * delay, BACKOFF_S[1])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def info(self) -> dict:
        return {"alive": self.alive(), "pid": self.proc.pid if self.proc else None, "restarts": self.restarts,
                "node": self.node, "host": self.host, "error": self.error}

    def tail(self, n: int = 20) -> str:
        from pathlib import Path

        from prodrl_pipelines.deploy_targets.processes import tail

        return tail(Path(self.spec["log"]), n) if self.spec else ""

    def stop(self, grace_s: float = 20.0) -> bool:
        """No more restarts; TERM the server's session, KILL what is left after ``grace_s``; True when
        one was running."""
        with self.lock:
            self.stopping = True
            return self._stop_proc(grace_s)

    def _stop_proc(self, grace_s: float) -> bool:
        import signal
        import subprocess

        if self.proc is None:
            return False
        was = self.proc.poll() is None
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # leftovers of its session (a child that outlived the server)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None
        return was
