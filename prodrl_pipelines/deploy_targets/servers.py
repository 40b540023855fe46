"""Managed server processes: ``prodrl-serve`` and ``vllm-restart`` (blue/green on two ports).

A deploy starts a new server on the export (served model name = the policy version) on the port the
current one does not hold (``target_port`` or ``target_port + 1``), waits until it is healthy and
serves that name, and only after the probe passed makes it current (endpoint file), drains and stops
the old one. A failed probe stops the new one: the old one never stopped serving.

Each server runs in a session of its own, so it outlives the Dagster run that started it; the next
run finds it again from the slot's record (pid, port, version, export): ``<home>/deployment/<target>/
current.json``, or a row beside the endpoint record in PostgreSQL (``slot_state``).
With ``replica_placement: ray`` each server is owned by a detached Ray actor on the node Ray picks
(``ray_placement``); its record adds the node, its address and the actor's name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import (
    is_moe,
    DeployError,
    Endpoint,
    Switch,
    wait_healthy,
)
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file
from prodrl_pipelines.deploy_targets.fleet_canary import FleetCanary
from prodrl_pipelines.deploy_targets.server_records import (
    ServerRecord, blue_green_port, process_start, record_alive, same_server, stop_record, stop_recorded,
)
from prodrl_pipelines.deploy_targets.slot_state import slots_for

# Requests already accepted by the old server finish before it is stopped (the recorder switched
# to the new one when the endpoint file changed).
DRAIN_S = 2.0


class ManagedServerTarget(FleetCanary):
    """A restart target: subclasses give the command line of a server on (export, port, version).

    ``deploy.replicas`` servers (slots 0..N-1) serve behind the endpoint file; slot i uses ports
    ``target_port + 2i`` and the next, blue/green. ``switch`` starts the new servers of a wave of slots
    beside the old ones and waits until they are healthy; ``commit`` makes them current (endpoint file:
    every replica), then drains and stops the old ones; ``rollback`` stops the new ones; ``restore``
    brings the previous version back on slots of waves already committed (a later wave failed).
    """

    name = "managed"
    ready_timeout_default = 180.0

    def __init__(self, settings, home: str | os.PathLike, *, state_name: str | None = None,
                 dev_mode: bool = False, cluster=None) -> None:
        self.settings = settings
        self.deploy = settings.deploy
        self.home = Path(home)
        self.dir = self.home / "deployment" / (state_name or self.name)  # logs; the slots' records on one host
        self.slots = slots_for(self.dir, self.deploy, state_name or self.name)
        self.dev_mode = dev_mode
        self.host = "127.0.0.1"
        self.replicas = int(self.deploy.replicas)
        self.cluster = cluster  # ClusterSettings (replica_placement ray); None: from PRODRL_SETTINGS_JSON
        self._ray = None

    # what a subclass defines
    def command(self, export_dir: Path, port: int, policy_version: str) -> list[str]:
        raise NotImplementedError

    def environment(self, port: int) -> dict:
        return dict(os.environ)

    def api_key(self) -> str | None:
        """The key this deployment's servers require (None: they require none)."""
        return self.server_environment(int(self.deploy.target_port)).get("VLLM_API_KEY") or None

    def server_environment(self, port: int) -> dict:
        """``environment(port)`` with the deployment's key (``PRODRL_DEPLOY_API_KEY``) as the server's
        ``VLLM_API_KEY`` when none is set: a server never listens without the key its deployment has."""
        from prodrl_pipelines.config import environment

        env = self.environment(port)
        key = environment.deploy_api_key()
        if key and not env.get("VLLM_API_KEY"):
            env["VLLM_API_KEY"] = key
        return env

    def current(self, slot: int = 0) -> ServerRecord | None:
        raw = self.slots.read(slot, "current")
        rec = ServerRecord(**self.refreshed(raw)) if raw else None
        return rec if rec is not None and rec.alive() else None

    # a Ray-placed server moves when its actor brought it back elsewhere: the record's address is the
    # one it had at its start, the cluster's store has where it is now
    def refreshed(self, raw: dict) -> dict:
        if not raw.get("actor"):
            return raw
        from prodrl_pipelines.deploy_targets.ray_placement import refresh

        return refresh(raw)

    def mark_live(self, raw: dict | None) -> None:
        """The server the slot comes back to after a failure (Ray placement; a local one is not restarted)."""
        if raw and raw.get("actor"):
            from prodrl_pipelines.deploy_targets.ray_placement import mark_live

            mark_live(raw)

    def keep_addresses(self) -> None:
        """Ray placement: the fleet keeper, which moves a replica's URL in the endpoint file when its
        actor brought it back at another address (started once per deployment)."""
        if self.on_ray():
            from prodrl_pipelines.deploy_targets.fleet_keeper import ensure_keeper

            ensure_keeper(self)

    def currents(self) -> list[ServerRecord | None]:
        return [self.current(i) for i in range(self.replicas)]

    def _ports(self, slot: int = 0) -> tuple[int, int]:
        p = int(self.deploy.target_port) + 2 * slot
        return p, p + 1

    def waves(self) -> list[list[int]]:
        """The slots a rolling update replaces together, in order (at most ``max_unavailable`` each)."""
        k = int(self.deploy.max_unavailable)
        return [list(range(i, min(i + k, self.replicas))) for i in range(0, self.replicas, k)]

    def on_ray(self) -> bool:
        return getattr(self.deploy, "replica_placement", "local") == "ray"

    def ray_placement(self):
        if self._ray is None:
            from prodrl_pipelines.deploy_targets.ray_placement import placement_for

            self._ray = placement_for(self)
        return self._ray

    def start(self, export_dir: Path, policy_version: str, port: int, slot: int | str = 0) -> ServerRecord:
        log = self.dir / "logs" / f"{policy_version}-{port}.log"
        if self.on_ray():
            from prodrl_pipelines.deploy_targets.ray_placement import start_replica

            avoid = self.other_nodes(slot) if self.deploy.replica_spread and slot != self.CANARY else ()
            return ServerRecord(**start_replica(self, Path(export_dir), policy_version, port, slot, str(log),
                                                avoid_nodes=avoid))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            proc = subprocess.Popen(self.command(export_dir, port, policy_version), env=self.server_environment(port),
                                    stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        return ServerRecord(pid=proc.pid, port=port, url=f"http://{self.host}:{port}", policy_version=policy_version,
                            export_dir=str(export_dir), log=str(log), started_at=time.time(),
                            pid_start=process_start(proc.pid) or 0)

    def other_nodes(self, slot) -> tuple[str, ...]:
        """The nodes holding the other slots' servers, current and pending (``replica_spread``)."""
        nodes = set()
        for other in range(self.replicas):
            for kind in ("current", "pending"):
                raw = self.slots.read(other, kind) if other != slot else None
                if raw and raw.get("actor"):
                    nodes.add(self.refreshed(raw).get("node", ""))
        return tuple(sorted(n for n in nodes if n))

    def _stale(self, slot: int, port: int) -> None:
        """A server of ours left on ``port`` by a crashed deploy (pending, never committed) is stopped."""
        raw = self.slots.read(slot, "pending")
        if raw and blue_green_port(raw) == port and record_alive(raw):
            stop_record(raw)

    def _start_beside(self, slot: int, export_dir: Path, policy_version: str) -> tuple[ServerRecord, ServerRecord | None]:
        """A new server for ``slot`` on the port its current one does not hold (pending until commit)."""
        cur = self.current(slot)
        a, b = self._ports(slot)
        port = b if cur is not None and blue_green_port(asdict(cur)) == a else a
        self._stale(slot, port)
        rec = self.start(Path(export_dir), policy_version, port, slot)
        self.slots.write(slot, "pending", asdict(rec))
        return rec, cur

    def _wait(self, recs: list[ServerRecord], policy_version: str) -> None:
        for rec in recs:
            wait_healthy(rec.url, self.deploy.health_timeout_s, expect_model=policy_version,
                         api_key=self.api_key(), alive=rec.alive, log_tail=rec.log_tail)

    # the protocol
    def switch(self, export_dir: Path, policy_version: str, wave: list[int] | None = None) -> Switch:
        t0 = time.monotonic()
        wave = list(range(self.replicas)) if wave is None else list(wave)
        started: list[tuple[int, ServerRecord, ServerRecord | None]] = []
        try:
            for slot in wave:
                rec, cur = self._start_beside(slot, export_dir, policy_version)
                started.append((slot, rec, cur))
            self._wait([rec for _, rec, _ in started], policy_version)
        except BaseException:
            for slot, rec, _ in started:
                stop_record(asdict(rec))
                self.slots.drop(slot, "pending")
            raise
        _, first, first_cur = started[0]
        slots = [rec.slot(slot, cur) for slot, rec, cur in started]
        return Switch(self.name, policy_version, str(export_dir), first.url, policy_version,
                      seconds=time.monotonic() - t0, previous=asdict(first_cur) if first_cur else None,
                      detail={"pid": first.pid, "pid_start": first.pid_start, "port": first.port, "log": first.log,
                              "replaces": first_cur.policy_version if first_cur else "",
                              "wave": wave, "replicas": self.replicas, "slots": slots})

    def write_endpoint(self, policy_version: str, export_dir: str) -> None:
        """The endpoint file: every live replica (versions differ mid-update), the canary if one runs
        (as the file holds it now: read and written under the file's lock, so a canary stopped or
        paused meanwhile is not put back)."""
        # read before the lock: a Ray-placed record is refreshed and checked through the cluster (up to
        # 30 s a call), and the recorder pauses a canary under this lock
        reps = [r for r in self.currents() if r is not None]

        def change(old: Endpoint | None) -> Endpoint | None:
            if not reps:
                return None
            head = next((r for r in reps if r.policy_version == policy_version), reps[0])
            return Endpoint(head.url, head.policy_version, policy_version, self.name, export_dir,
                            replicas=[{"url": r.url, "served_model_name": r.policy_version,
                                       "policy_version": r.policy_version, **({"actor": r.actor} if r.actor else {})}
                                      for r in reps],
                            canary=old.canary if old is not None else None)

        endpoint_file(self.home, self.deploy).update(change)

    def commit(self, switch: Switch) -> None:
        slots = switch.detail["slots"]
        pending = [self.slots.read(s["slot"], "pending") for s in slots]
        for s, raw in zip(slots, pending):  # every slot checked before any changes
            if not raw or not same_server(raw, s):
                raise DeployError(f"{self.name}: no pending server for {switch.policy_version} on replica "
                                  f"{s['slot']} to commit")
        for s, raw in zip(slots, pending):
            self.slots.write(s["slot"], "current", raw)
            self.slots.drop(s["slot"], "pending")
            self.mark_live(raw)
        self.write_endpoint(switch.policy_version, switch.export_dir)
        self.keep_addresses()
        old = [s["previous"] for s in slots if s["previous"] and not same_server(s["previous"], s)]
        if old:
            time.sleep(DRAIN_S)
            for o in old:  # SIGTERM: the server finishes the requests it accepted (long streams too), then exits
                stop_record(o, grace_s=float(self.deploy.drain_timeout_s))

    def rollback(self, switch: Switch) -> str:
        """Stop the switch's new servers. A commit that failed half-way made some of them current:
        those slots get their previous server back (as current when it still runs, else restarted)
        and the endpoint file lists what serves then."""
        committed, lost = [], []
        for s in switch.detail["slots"]:
            cur = self.slots.read(s["slot"], "current")
            if cur and same_server(cur, s):
                committed.append(s)
                prev = s["previous"]
                if prev and record_alive(prev):
                    self.slots.write(s["slot"], "current", prev)
                    self.mark_live(prev)
                else:
                    self.slots.drop(s["slot"], "current")
                    lost.append(s)
        prev = next((s["previous"] for s in switch.detail["slots"] if s["previous"]), None)
        if committed and prev:
            self.write_endpoint(prev["policy_version"], prev["export_dir"])
        for s in switch.detail["slots"]:
            stop_record(s)
            self.slots.drop(s["slot"], "pending")
        notes = []
        if committed:
            notes.append(f"replicas {[s['slot'] for s in committed]} were committed: their previous servers "
                         "are current again")
        if lost:
            notes.append(self.restore([Switch(self.name, switch.policy_version, switch.export_dir, None,
                                              detail={"slots": lost})]))
        old = switch.previous
        if old and record_alive(old):
            notes.insert(0, f"stopped the new server; {old['policy_version']} kept serving at {old['url']}")
        elif not lost:
            notes.insert(0, "stopped the new server; nothing else was serving")
        else:
            notes.insert(0, "stopped the new server")
        return "; ".join(notes)

    def restore(self, switches: list[Switch]) -> str:
        """Bring back what served before on the slots of committed waves (latest first), blue/green."""
        done = []
        for sw in reversed(switches):
            for s in sw.detail["slots"]:
                prev = s["previous"]
                if not prev:
                    continue
                rec, cur = self._start_beside(s["slot"], Path(prev["export_dir"]), prev["policy_version"])
                self._wait([rec], prev["policy_version"])
                back = Switch(self.name, prev["policy_version"], prev["export_dir"], rec.url, prev["policy_version"],
                              detail={"slots": [rec.slot(s["slot"], cur)]})
                self.commit(back)
                done.append(f"replica {s['slot']}: {prev['policy_version']}")
        return ("restored " + ", ".join(done)) if done else "no committed wave to restore"

    def stop(self) -> None:
        """Stop every replica's servers (current and pending) and a canary: the end of this deployment."""
        if self.on_ray():
            from prodrl_pipelines.deploy_targets.fleet_keeper import stop_keeper

            stop_keeper(self)
        stop_recorded(self.slots, self.CANARY)
        for slot in range(max(self.replicas, 1)):
            stop_recorded(self.slots, slot)


class ProdrlServeTarget(ManagedServerTarget):
    """``prodrl serve`` (the local engine behind the OpenAI protocol) as a managed server."""

    name = "prodrl-serve"

    def command(self, export_dir: Path, port: int, policy_version: str) -> list[str]:
        k = self.deploy.num_top_logprobs
        routing = ["--enable-return-routed-experts"] if self.deploy.record_routing and is_moe(export_dir) else []
        from prodrl_pipelines.engines.reply_parsers import reply_parser_flags
        parser = reply_parser_flags(self.deploy.reply_parser, vllm=False)
        return [sys.executable, "-m", "prodrl_pipelines.cli", "serve", str(export_dir), "--host", self.host,
                "--port", str(port), "--served-model-name", policy_version, "--max-logprobs", str(max(k + 1, 20)),
                "--generation-config", "vllm", "--threads", "1", *routing, *parser, *self.deploy.server_args]


class VLLMRestartTarget(ManagedServerTarget):
    """vLLM's OpenAI server as a managed process (``vllm_serve_command``), restarted per deploy."""

    name = "vllm-restart"

    def command(self, export_dir: Path, port: int, policy_version: str) -> list[str]:
        from prodrl_pipelines.engines.vllm_client import vllm_serve_command

        k = self.deploy.num_top_logprobs
        self._routing = self.deploy.record_routing and is_moe(export_dir) and vllm_serves_routing()
        routing = ["--enable-return-routed-experts"] if self._routing else []
        from prodrl_pipelines.engines.reply_parsers import reply_parser_flags
        parser = reply_parser_flags(self.deploy.reply_parser, vllm=True)
        return vllm_serve_command(export_dir, port, max(k + 1, 20), host=self.host, served_model_name=policy_version,
                                  python=vllm_python(self.deploy), extra_args=[*routing, *parser, *self.deploy.server_args])

    def environment(self, port: int) -> dict:
        from prodrl_pipelines.engines.vllm_client import vllm_serve_env

        env = vllm_serve_env(self.host)
        if getattr(self, "_routing", False):  # vLLM 0.32 captures routing in its V2 model runner only
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        if "VLLM_CPU_OMP_THREADS_BIND" not in env and not cuda_available():
            # vLLM's CPU engine pins its OpenMP threads (auto: the same first cores for every server):
            # blue and green, alive together during a switch, get disjoint halves of the cores, else
            # the new one starves behind the busy old one (measured: no start-up within 150 s)
            env["VLLM_CPU_OMP_THREADS_BIND"] = core_half((port - int(self.deploy.target_port)) % 2)
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /collective_rpc, /resume for in-place reloads
        return env


def vllm_serves_routing() -> bool:
    """Whether vLLM can return routed experts here: its capture needs the V2 model runner, which
    needs Triton with a backend for the device. The CPU build refuses to start with the flag (checked
    with vLLM 0.32 CPU: "Model Runner V2 requires Triton"), so MoE deployments on CPU record no routing."""
    return cuda_available()


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
