"""Adapter targets (``vllm-lora``, ``prodrl-serve-lora``): a LoRA round's adapter loaded into the
servers that already run its base, no restart.

Each server runs a base export (served as the base's policy version) with LoRA enabled. A LoRA
round's export (``quant.adapter_export``) is deployed by loading its adapter into every running
server of the wave under the round's own name (``POST /v1/load_lora_adapter``; one name per version:
vLLM 0.32 reloads from disk on every step when a name is reused in place), waiting until
``/v1/models`` lists it, probing it there, then routing the fleet's served model name to it
(endpoint record): the recorder sends the next calls to the adapter and files them under its name,
which is the policy version. A rollback routes back to the previous adapter, still loaded, and
unloads the rejected one (at the next deploy if calls were routed to it). Beyond
``deploy.lora_kept_adapters`` per server the oldest adapters are unloaded, but never at the deploy
that routed away from them: a call the recorder routed just before the switch (or still in flight)
reaches the server after it, and must still find its adapter (vLLM answers 404 for an unloaded
name). So the adapter a deploy replaces, and a canary taken off traffic, are unloaded at the next
deploy, not on a timer.

What cannot be hot-loaded is started, blue/green, as by the restart targets: the first deploy, a
whole-model export (a full round), an adapter on another base, a server that is down. A started
server runs the base export with the adapter given at start-up (``--lora-modules``).

A canary whose adapter fits the fleet's base is loaded into the fleet's servers and given its slice
of trajectories under its own name: no server of its own.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import DeployError, Endpoint, Switch, is_moe, wait_healthy
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file
from prodrl_pipelines.deploy_targets.server_records import ServerRecord, same_server
from prodrl_pipelines.deploy_targets.servers import ProdrlServeTarget, VLLMRestartTarget, cuda_available
from prodrl_pipelines.quant.adapter_export import adapter_export, adapter_rank

# vLLM's accepted --max-lora-rank values (0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterServing:
    """Mixed into a ``ManagedServerTarget`` whose servers load adapters at run time (``lora_args``)."""

    def lora_args(self, adapter: tuple[str, Path] | None) -> list[str]:
        raise NotImplementedError

    # what runs: a base export, the adapter given at start-up
    def start(self, export_dir: Path, policy_version: str, port: int, slot=0) -> ServerRecord:
        if self.on_ray():
            raise DeployError(f"{self.name}: replica_placement 'ray' is not built for adapter targets")
        part = adapter_export(export_dir)
        self._starting = (policy_version, part)
        try:
            base_export, base_version = (part[2], part[1]) if part else (Path(export_dir), policy_version)
            rec = super().start(Path(base_export), base_version, port, slot)
        finally:
            self._starting = None
        rec.policy_version, rec.export_dir = policy_version, str(export_dir)
        rec.base_version, rec.adapters = base_version, ([policy_version] if part else [])
        return rec

    def command(self, export_dir: Path, port: int, policy_version: str) -> list[str]:
        version, part = getattr(self, "_starting", None) or (policy_version, None)
        if part is not None:
            self.check_serves(part[2], Path(part[0]))
        return [*super().command(export_dir, port, policy_version),
                *self.lora_args((version, part[0]) if part else None)]

    def check_serves(self, base_export: Path, adapter: Path) -> None:
        """What this server cannot serve is refused before it starts (naming both sides)."""
        rank = adapter_rank(adapter.parent)
        if rank > int(self.deploy.lora_max_rank):
            raise DeployError(f"the adapter {adapter} has rank {rank} > deploy.lora_max_rank "
                              f"{self.deploy.lora_max_rank} (the servers' --max-lora-rank)")

    # the running servers' adapters
    def _post(self, url: str, path: str, body: dict) -> tuple[int, str]:
        headers = {"Content-Type": "application/json"}
        key = self.api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=float(self.deploy.health_timeout_s)) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except OSError as e:
            raise DeployError(f"POST {url}{path} failed: {e}") from None

    def load_adapter(self, url: str, name: str, adapter: Path) -> bool:
        """False when the server already has it: a version's name always means the same adapter (a
        running canary's being promoted, one taken off traffic and not unloaded yet)."""
        status, text = self._post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter)})
        if status == 400 and "already been loaded" in text:
            return False
        if status != 200:
            raise DeployError(f"{url} refused to load the adapter {name} ({adapter}): HTTP {status}: {text[:300]}")
        return True

    def unload_adapter(self, url: str, name: str) -> bool:
        """False when the server does not have it (nothing to do)."""
        status, text = self._post(url, "/v1/unload_lora_adapter", {"lora_name": name})
        if status in (400, 404) and ("not" in text.lower() or "cannot be found" in text):
            return False
        if status != 200:
            raise DeployError(f"{url} refused to unload the adapter {name}: HTTP {status}: {text[:300]}")
        return True

    def hot_loadable(self, export_dir: Path, slots: list, policy_version: str) -> tuple[Path | None, str] | None:
        """(adapter, base version) when ``export_dir`` is an adapter every server of ``slots`` can
        take (each runs, on that base), (None, version) when it is the base those servers run (a
        rollback to it routes back to the base's name); None: the wave is started anew."""
        part = adapter_export(export_dir)
        base_version = part[1] if part else policy_version
        curs = [self.current(s) for s in slots]
        if any(c is None or c.base_version != base_version for c in curs):
            return None
        return (part[0] if part else None), base_version

    def _load_into(self, recs: list[ServerRecord], version: str, adapter: Path) -> list[ServerRecord]:
        """Load into each server that lacks it and wait until it serves it; the servers it was loaded into
        (on a failure, those are unloaded again before the error is raised)."""
        loaded = []
        try:
            for rec in recs:
                if version not in rec.adapters and self.load_adapter(rec.url, version, adapter):
                    loaded.append(rec)
            for rec in recs:
                wait_healthy(rec.url, self.deploy.health_timeout_s, expect_model=version, api_key=self.api_key(),
                             alive=rec.alive, log_tail=rec.log_tail)
        except BaseException:
            for rec in loaded:
                self._unload_quietly(rec.url, version)
            raise
        return loaded

    def _unload_quietly(self, url: str, name: str) -> str:
        try:
            self.unload_adapter(url, name)
            return ""
        except DeployError as e:
            return f"; {e}"

    # the protocol
    def switch(self, export_dir: Path, policy_version: str, wave: list[int] | None = None) -> Switch:
        wave = list(range(self.replicas)) if wave is None else list(wave)
        hot = self.hot_loadable(Path(export_dir), wave, policy_version)
        if hot is None:
            sw = super().switch(export_dir, policy_version, wave)
            sw.detail.update(mode="start", **served_adapter(export_dir))
            return sw
        t0 = time.monotonic()
        adapter, _ = hot
        if adapter is not None:  # the running servers were started for this rank at most
            self.check_serves(adapter_export(export_dir)[2], adapter)
        curs = [self.current(s) for s in wave]
        loaded = self._load_into(curs, policy_version, adapter) if adapter is not None else []
        slots = []
        for slot, cur in zip(wave, curs):
            kept = [a for a in cur.adapters if a != policy_version] + ([policy_version] if adapter is not None else [])
            pending = {**asdict(cur), "policy_version": policy_version, "export_dir": str(export_dir), "adapters": kept}
            self.slots.write(slot, "pending", pending)
            slots.append(cur.slot(slot, cur))
        first = curs[0]
        return Switch(self.name, policy_version, str(export_dir), first.url, policy_version,
                      seconds=time.monotonic() - t0, previous=asdict(first),
                      detail={"mode": "adapter", **({"adapter": str(adapter)} if adapter else {}), "wave": wave,
                              "replicas": self.replicas,
                              "slots": slots, "loaded": [r.url for r in loaded], "replaces": first.policy_version})

    def commit(self, switch: Switch) -> None:
        super().commit(switch)  # an adapter's switch keeps its servers: nothing is stopped
        self._unload_retired_canaries()
        self.prune(switch.detail["slots"], spare=switch.detail.get("replaces"))

    def prune(self, slots: list[dict], spare: str | None = None) -> list[str]:
        """Unload, per server, the oldest adapters beyond ``deploy.lora_kept_adapters``: never the one
        routed to, the canary's, nor ``spare`` (the one this deploy routed away from: calls routed to it
        before the switch may still arrive)."""
        keep = int(self.deploy.lora_kept_adapters)
        canary = (endpoint_file(self.home, self.deploy).read() or Endpoint("", "", "")).canary or {}
        done = []
        for s in slots:
            raw = self.slots.read(s["slot"], "current")
            if not raw or not raw.get("adapters"):
                continue
            names = list(raw["adapters"])
            spared = (raw["policy_version"], canary.get("policy_version"), spare)
            drop = [n for n in names[:-keep] if n not in spared] if len(names) > keep else []
            for name in drop:
                self._unload_quietly(raw["url"], name)
                names.remove(name)
                done.append(f"{name} from replica {s['slot']}")
            if drop:
                self.slots.write(s["slot"], "current", {**raw, "adapters": names})
        return done

    def rollback(self, switch: Switch) -> str:
        if switch.detail.get("mode") != "adapter":
            return super().rollback(switch)
        routed_back = []
        for s in switch.detail["slots"]:
            cur = self.slots.read(s["slot"], "current")
            if cur and same_server(cur, s) and cur["policy_version"] == switch.policy_version and s["previous"]:
                self.slots.write(s["slot"], "current", {**s["previous"], "adapters": cur.get("adapters", [])})
                routed_back.append(s)
            self.slots.drop(s["slot"], "pending")
        prev = switch.previous or {}
        if routed_back:
            self.write_endpoint(prev["policy_version"], prev["export_dir"])
        notes, cand = "", switch.policy_version
        for s in switch.detail["slots"]:
            if s["url"] not in switch.detail.get("loaded", []):  # one it had before stays (a kept version)
                continue
            raw = self.slots.read(s["slot"], "current") or {}
            others = [a for a in raw.get("adapters", []) if a != cand]
            if routed_back:  # calls were routed to it: the oldest now, unloaded at the next deploy
                self.slots.write(s["slot"], "current", {**raw, "adapters": [cand, *others]})
            else:  # only the probe ever called it
                notes += self._unload_quietly(s["url"], cand)
                if raw:
                    self.slots.write(s["slot"], "current", {**raw, "adapters": others})
        if routed_back:
            return (f"routed back to {prev.get('policy_version')} on the same servers (no restart); {cand} unloaded "
                    f"at the next deploy{notes}")
        return f"{prev.get('policy_version')} kept serving on the same servers (no restart); unloaded {cand}{notes}"

    def restore(self, switches: list[Switch]) -> str:
        done = []
        for sw in reversed(switches):
            done.append(self.rollback(sw) if sw.detail.get("mode") == "adapter" else super().restore([sw]))
        return "; ".join(done) if done else "no committed wave to restore"

    # a canary on the fleet's own servers
    def switch_canary(self, export_dir: Path, policy_version: str) -> Switch:
        self._stop_old_canary()
        hot = self.hot_loadable(Path(export_dir), list(range(self.replicas)), policy_version)
        if hot is None or hot[0] is None:  # the base itself as a canary: a server of its own
            sw = super().switch_canary(export_dir, policy_version)
            sw.detail.update(mode="start", **served_adapter(export_dir))
            return sw
        t0 = time.monotonic()
        self.check_serves(adapter_export(export_dir)[2], hot[0])
        curs = [c for c in self.currents() if c is not None]
        loaded = self._load_into(curs, policy_version, hot[0])
        record = {"adapter_canary": True, "policy_version": policy_version, "export_dir": str(export_dir),
                  "urls": [c.url for c in curs], "loaded": [r.url for r in loaded]}
        self.slots.write(self.CANARY, "pending", record)
        return Switch(self.name, policy_version, str(export_dir), curs[0].url, policy_version,
                      seconds=time.monotonic() - t0,
                      detail={"mode": "adapter", "role": "canary", "adapter": str(hot[0]), "slots": [],
                              "urls": record["urls"]})

    def commit_canary(self, switch: Switch, fraction: float) -> None:
        if switch.detail.get("mode") != "adapter":
            return super().commit_canary(switch, fraction)

        def change(ep: Endpoint | None) -> Endpoint:
            raw = self.slots.read(self.CANARY, "pending")
            if not raw or raw.get("policy_version") != switch.policy_version:
                raise DeployError(f"{self.name}: no pending canary for {switch.policy_version} to commit")
            if ep is None:
                raise DeployError("a canary needs a live deployment beside it (no endpoint file)")
            self.slots.write(self.CANARY, "current", raw)
            self.slots.drop(self.CANARY, "pending")
            ep.canary = {"fraction": float(fraction), "policy_version": switch.policy_version,
                         "export_dir": switch.export_dir,
                         "replicas": [{"url": u, "served_model_name": switch.policy_version,
                                       "policy_version": switch.policy_version} for u in raw["urls"]]}
            return ep

        endpoint_file(self.home, self.deploy).update(change)

    def _stop_old_canary(self) -> list[str]:
        """A running adapter canary taken off traffic; its adapter stays loaded until the next deploy or
        canary (calls routed to it just before may still arrive). A server canary is the base's to stop."""
        self._unload_retired_canaries()
        raw = self.slots.read(self.CANARY, "current") or self.slots.read(self.CANARY, "pending")
        if not raw or not raw.get("adapter_canary"):
            return []
        records = [r for r in self.take_canary()[1] if r.get("adapter_canary")]
        self.slots.write(self.CANARY, "retired", {"canaries": self._retired_canaries() + records})
        return [r["policy_version"] for r in records]

    def _retired_canaries(self) -> list[dict]:
        return (self.slots.read(self.CANARY, "retired") or {}).get("canaries", [])

    def _unload_retired_canaries(self) -> list[str]:
        """The adapters of canaries taken off traffic earlier, unloaded from the fleet's servers unless the
        fleet now serves them (a promoted canary)."""
        records = self._retired_canaries()
        if not records:
            return []
        servers = [c for c in self.currents() if c is not None]
        serving = {c.policy_version for c in servers} | {a for c in servers for a in c.adapters}
        for raw in records:
            if raw["policy_version"] not in serving:
                for url in raw["urls"]:
                    self._unload_quietly(url, raw["policy_version"])
        self.slots.drop(self.CANARY, "retired")
        return [r["policy_version"] for r in records]

    def stop_canary(self) -> str:
        raw = self.slots.read(self.CANARY, "current") or self.slots.read(self.CANARY, "pending")
        if not raw or not raw.get("adapter_canary"):
            return super().stop_canary()
        stopped = self._stop_old_canary()
        return (f"stopped the canary adapter ({', '.join(stopped)}) on the fleet's servers "
                "(unloaded at the next deploy)")

    def stop(self) -> None:
        for kind in ("pending", "current"):
            raw = self.slots.read(self.CANARY, kind)
            if raw and raw.get("adapter_canary"):
                self.slots.drop(self.CANARY, kind)
        self.slots.drop(self.CANARY, "retired")
        super().stop()


class VLLMLoRATarget(AdapterServing, VLLMRestartTarget):
    """vLLM with runtime LoRA updating (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""

    name = "vllm-lora"

    def lora_args(self, adapter: tuple[str, Path] | None) -> list[str]:
        # the kept ones, the one a deploy routed away from, a candidate, a canary and a retired canary at once
        n = str(int(self.deploy.lora_kept_adapters) + 4)
        args = ["--enable-lora", "--max-lora-rank", str(self.deploy.lora_max_rank), "--max-loras", n,
                "--max-cpu-loras", n]
        return args + (["--lora-modules", f"{adapter[0]}={adapter[1]}"] if adapter else [])

    def check_serves(self, base_export: Path, adapter: Path) -> None:
        super().check_serves(base_export, adapter)
        if is_moe(base_export) and not cuda_available():
            raise DeployError(f"{self.name} cannot serve the adapter {adapter} on the MoE export {base_export} here: "
                              "vLLM serves LoRA on MoE layers with GPU kernels only (its CPU build refuses it)")

    def environment(self, port: int) -> dict:
        env = super().environment(port)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        return env


class ProdrlServeLoRATarget(AdapterServing, ProdrlServeTarget):
    """``prodrl serve --enable-lora``: adapters loaded beside its base (``engines.serve_adapters``)."""

    name = "prodrl-serve-lora"

    def lora_args(self, adapter: tuple[str, Path] | None) -> list[str]:
        return ["--enable-lora"] + (["--lora-modules", f"{adapter[0]}={adapter[1]}"] if adapter else [])


def served_adapter(export_dir: Path) -> dict:
    """What a switch tells the parity probe: the adapter its servers serve on the base (the probe's
    reference is then base export + adapter, as served); {} for a whole-model export."""
    part = adapter_export(export_dir)
    return {"adapter": str(part[0])} if part else {}
