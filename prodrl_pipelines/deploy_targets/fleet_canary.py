"""The canary of a managed fleet: one more server beside the rolling slots, given a sticky fraction of
trajectories while the candidate is judged on live traffic.

It runs on the pair of ports after the fleet's and is placed like any replica (a local process, or a
Ray actor's server with ``replica_placement: ray``); it is started, checked and stopped through its
record, so the same code serves both placements.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import DeployError, Endpoint, Switch
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file
from prodrl_pipelines.deploy_targets.server_records import (
    ServerRecord, blue_green_port, record_alive, same_server, stop_record,
)

# Requests already routed to the canary finish before it is stopped.
CANARY_DRAIN_S = 2.0


class FleetCanary:
    """Mixed into ``ManagedServerTarget`` (``start``, ``_wait``, ``deploy``, ``slots``, ``home``)."""

    CANARY = "canary"

    def canary(self) -> ServerRecord | None:
        raw = self.slots.read(self.CANARY, "current")
        rec = ServerRecord(**self.refreshed(raw)) if raw else None
        return rec if rec is not None and rec.alive() else None

    def switch_canary(self, export_dir: Path, policy_version: str) -> Switch:
        """Start the candidate beside the fleet and wait until it is healthy (nothing routed to it yet)."""
        t0 = time.monotonic()
        port = int(self.deploy.target_port) + 2 * self.replicas
        old = self.slots.read(self.CANARY, "current")
        if old and record_alive(old):
            stop_record(old)
        busy = bool(old) and blue_green_port(old) == port
        rec = self.start(Path(export_dir), policy_version, port + (1 if busy else 0), slot=self.CANARY)
        self.slots.write(self.CANARY, "pending", asdict(rec))
        try:
            self._wait([rec], policy_version)
        except BaseException:
            stop_record(asdict(rec))
            self.slots.drop(self.CANARY, "pending")
            raise
        return Switch(self.name, policy_version, str(export_dir), rec.url, policy_version,
                      seconds=time.monotonic() - t0,
                      detail={"pid": rec.pid, "pid_start": rec.pid_start, "port": rec.port, "log": rec.log, "actor": rec.actor,
                              "role": "canary", "slots": []})

    def commit_canary(self, switch: Switch, fraction: float) -> None:
        """Route ``fraction`` of trajectories (sticky per trajectory id) to the canary; one step under
        the endpoint file's lock, so it cannot interleave with a ``stop_canary``."""
        def change(ep: Endpoint | None) -> Endpoint:
            raw = self.slots.read(self.CANARY, "pending")
            if not raw or not same_server(raw, switch.detail):
                raise DeployError(f"{self.name}: no pending canary for {switch.policy_version} to commit")
            if ep is None:
                raise DeployError("a canary needs a live deployment beside it (no endpoint file)")
            self.slots.write(self.CANARY, "current", raw)
            self.slots.drop(self.CANARY, "pending")
            self.mark_live(raw)
            ep.canary = {"fraction": float(fraction), "policy_version": switch.policy_version,
                         "export_dir": switch.export_dir,
                         "replicas": [{"url": switch.endpoint, "served_model_name": switch.policy_version,
                                       "policy_version": switch.policy_version,
                                       **({"actor": raw["actor"]} if raw.get("actor") else {})}]}
            return ep

        endpoint_file(self.home, self.deploy).update(change)
        self.keep_addresses()

    def stop_canary(self) -> str:
        """No more traffic to the canary (endpoint file first, and its records taken, under the file's
        lock), then its server drains and stops."""
        routed, records = self.take_canary()
        stopped = []
        for raw in records:
            alive = record_alive(raw)
            if alive:
                stopped.append(raw["policy_version"])
            if alive or raw.get("actor"):  # an actor whose server died goes too, with its group
                stop_record(raw)
        paused = routed[0].get("paused") if routed and isinstance(routed[0].get("paused"), dict) else None
        why = f"; it had been taken off traffic: {paused.get('reason', '')}" if paused else ""
        if stopped or paused:
            return f"stopped the canary ({', '.join(stopped) or 'no longer running'}){why}"
        return "no canary was running"

    def take_canary(self) -> tuple[list[dict], list[dict]]:
        """The canary off traffic and its records taken, in one step under the endpoint file's lock (so
        it cannot interleave with a ``commit_canary``), then the calls routed to it drain: (what the
        endpoint file routed, the records)."""
        routed, records = [], []

        def change(ep: Endpoint | None) -> Endpoint | None:
            for kind in ("pending", "current"):
                raw = self.slots.read(self.CANARY, kind)
                if raw:
                    records.append(raw)
                self.slots.drop(self.CANARY, kind)
            if ep is None or not ep.canary:
                return None
            routed.append(ep.canary)
            ep.canary = None
            return ep

        endpoint_file(self.home, self.deploy).update(change)
        if routed:
            time.sleep(CANARY_DRAIN_S)
        return routed, records
