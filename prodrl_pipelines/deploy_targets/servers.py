"""Managed server processes: ``prodrl-serve`` and ``vllm-restart`` (blue/green on two ports).

A deploy starts a new server on the export (served model name = the policy version) on the port the
current one does not hold (``target_port`` or ``target_port + 1``), waits until it is healthy and
serves that name, and only after the probe passed makes it current (endpoint file), drains and stops
the old one. A failed probe stops the new one: the old one never stopped serving.

Each server runs in a session of its own, so it outlives the Dagster run that started it; the next
run finds it again from ``<home>/deployment/<target>/current.json`` (pid, port, version, export).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import (
    DeployError,
    Endpoint,
    Switch,
    endpoint_file,
    read_json,
    wait_healthy,
    write_json,
)
from prodrl_pipelines.deploy_targets.processes import tail

# Requests already accepted by the old server finish before it is stopped (the recorder switched
# to the new one when the endpoint file changed).
DRAIN_S = 2.0


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


@dataclass
class ServerRecord:
    pid: int
    port: int
    url: str
    policy_version: str
    export_dir: str
    log: str
    started_at: float

    def alive(self) -> bool:
        return pid_alive(self.pid)


class ManagedServerTarget:
    """A restart target: subclasses give the command line of a server on (export, port, version)."""

    name = "managed"
    ready_timeout_default = 180.0

    def __init__(self, settings, home: str | os.PathLike, *, state_name: str | None = None,
                 dev_mode: bool = False) -> None:
        self.settings = settings
        self.deploy = settings.deploy
        self.home = Path(home)
        self.dir = self.home / "deployment" / (state_name or self.name)  # pid/port state, logs
        self.dev_mode = dev_mode
        self.host = "127.0.0.1"

    # what a subclass defines
    def command(self, export_dir: Path, port: int, policy_version: str) -> list[str]:
        raise NotImplementedError

    def environment(self, port: int) -> dict:
        return dict(os.environ)

    # state
    def current(self) -> ServerRecord | None:
        raw = read_json(self.dir / "current.json")
        rec = ServerRecord(**raw) if raw else None
        return rec if rec is not None and rec.alive() else None

    def _ports(self) -> tuple[int, int]:
        p = int(self.deploy.target_port)
        return p, p + 1

    def start(self, export_dir: Path, policy_version: str, port: int) -> ServerRecord:
        log = self.dir / "logs" / f"{policy_version}-{port}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            proc = subprocess.Popen(self.command(export_dir, port, policy_version), env=self.environment(port),
                                    stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        return ServerRecord(pid=proc.pid, port=port, url=f"http://{self.host}:{port}", policy_version=policy_version,
                            export_dir=str(export_dir), log=str(log), started_at=time.time())

    def _stale(self, port: int) -> None:
        """A server of ours left on ``port`` by a crashed deploy (pending, never committed) is stopped."""
        raw = read_json(self.dir / "pending.json")
        if raw and int(raw["port"]) == port and pid_alive(int(raw["pid"])):
            stop_process_group(int(raw["pid"]))

    # the protocol
    def switch(self, export_dir: Path, policy_version: str) -> Switch:
        t0 = time.monotonic()
        cur = self.current()
        a, b = self._ports()
        port = b if cur is not None and cur.port == a else a
        self._stale(port)
        rec = self.start(Path(export_dir), policy_version, port)
        write_json(self.dir / "pending.json", asdict(rec))
        try:
            wait_healthy(rec.url, self.deploy.health_timeout_s, expect_model=policy_version,
                         alive=rec.alive, log_tail=lambda: tail(Path(rec.log)))
        except BaseException:
            stop_process_group(rec.pid)
            (self.dir / "pending.json").unlink(missing_ok=True)
            raise
        return Switch(self.name, policy_version, str(export_dir), rec.url, policy_version,
                      seconds=time.monotonic() - t0, previous=asdict(cur) if cur else None,
                      detail={"pid": rec.pid, "port": rec.port, "log": rec.log,
                              "replaces": cur.policy_version if cur else ""})

    def commit(self, switch: Switch) -> None:
        raw = read_json(self.dir / "pending.json")
        if not raw or int(raw["pid"]) != int(switch.detail["pid"]):
            raise DeployError(f"{self.name}: no pending server for {switch.policy_version} to commit")
        write_json(self.dir / "current.json", raw)
        (self.dir / "pending.json").unlink(missing_ok=True)
        endpoint_file(self.home).write(Endpoint(switch.endpoint, switch.policy_version, switch.policy_version, self.name,
                                                 switch.export_dir))
        old = switch.previous
        if old and int(old["pid"]) != int(raw["pid"]):
            time.sleep(DRAIN_S)
            stop_process_group(int(old["pid"]))

    def rollback(self, switch: Switch) -> str:
        stop_process_group(int(switch.detail["pid"]))
        (self.dir / "pending.json").unlink(missing_ok=True)
        old = switch.previous
        if old and pid_alive(int(old["pid"])):
            return f"stopped the new server; {old['policy_version']} kept serving at {old['url']}"
        return "stopped the new server; nothing else was serving"

    def stop(self) -> None:
        """Stop the current server (and a pending one): the end of this deployment."""
        for name in ("pending.json", "current.json"):
            raw = read_json(self.dir / name)
            if raw and pid_alive(int(raw["pid"])):
                stop_process_group(int(raw["pid"]))
            (self.dir / name).unlink(missing_ok=True)


class ProdrlServeTarget(ManagedServerTarget):
    """``prodrl serve`` (the local engine behind the OpenAI protocol) as a managed server."""

    name = "prodrl-serve"

    def command(self, export_dir: Path, port: int, policy_version: str) -> list[str]:
        k = self.deploy.num_top_logprobs
        return [sys.executable, "-m", "prodrl_pipelines.cli", "serve", str(export_dir), "--host", self.host,
                "--port", str(port), "--served-model-name", policy_version, "--max-logprobs", str(max(k + 1, 20)),
                "--generation-config", "vllm", "--threads", "1", *self.deploy.server_args]


class VLLMRestartTarget(ManagedServerTarget):
    """vLLM's OpenAI server as a managed process (``vllm_serve_command``), restarted per deploy."""

    name = "vllm-restart"

    def command(self, export_dir: Path, port: int, policy_version: str) -> list[str]:
        from prodrl_pipelines.engines.vllm_client import vllm_serve_command

        k = self.deploy.num_top_logprobs
        return vllm_serve_command(export_dir, port, max(k + 1, 20), host=self.host, served_model_name=policy_version,
                                  python=vllm_python(self.deploy), extra_args=self.deploy.server_args)

    def environment(self, port: int) -> dict:
        from prodrl_pipelines.engines.vllm_client import vllm_serve_env

        env = vllm_serve_env(self.host)
        if "VLLM_CPU_OMP_THREADS_BIND" not in env and not cuda_available():
            # vLLM's CPU engine pins its OpenMP threads (auto: the same first cores for every server):
            # blue and green, alive together during a switch, get disjoint halves of the cores, else
            # the new one starves behind the busy old one (measured: no start-up within 150 s)
            env["VLLM_CPU_OMP_THREADS_BIND"] = core_half(self._ports().index(port))
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /collective_rpc, /resume for in-place reloads
        return env


def cuda_available() -> bool:
    """Whether torch sees a GPU (False without torch)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch: not a GPU host
        return False


def core_half(slot: int) -> str:
    """The cores of blue/green slot 0 or 1 (``VLLM_CPU_OMP_THREADS_BIND`` syntax: ``0-3`` or ``1``)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "nobind"
    half = len(cpus) // 2
    mine = cpus[:half] if slot == 0 else cpus[half:2 * half]
    return ",".join(str(c) for c in mine)


def vllm_python(deploy) -> str | None:
    """The interpreter of vLLM's environment: ``deploy.vllm_python``, else ``environment.vllm_python()``."""
    from prodrl_pipelines.config import environment

    return deploy.vllm_python or environment.vllm_python()
