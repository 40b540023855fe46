"""One deploy, start to finish: switch, health check, parity probe, then commit or roll back.

A target with several replicas (``waves()``) is updated wave by wave: each wave's new servers are
switched, health-checked and probed (every one of them: a wave of several new servers is only as good
as its worst), then committed (its old servers drain), before the next wave starts; a failure in any
wave, the commit included, rolls that wave back and restores the waves already committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import DeployError, Switch, wait_healthy
from prodrl_pipelines.deploy_targets.probe import ProbeResult, parity_probe, parity_probes


@dataclass
class Rollout:
    switch: Switch
    probe: ProbeResult | None
    seconds: float  # from "deploy" to "probe passed" (and committed); a fleet: its last wave
    waves: int = 1

    def metadata(self) -> dict:
        out = {**self.switch.summary(), "deploy_seconds": round(self.seconds, 3), "waves": self.waves}
        if self.probe is not None:
            out.update({k: v for k, v in self.probe.metrics().items() if k != "probe_passed"})
        return out


class DeployRejected(DeployError):
    """The new deployment failed its health check or parity probe and was rolled back."""

    def __init__(self, reason: str, switch: Switch | None, probe: ProbeResult | None, rollback: str) -> None:
        super().__init__(f"{reason} (rolled back: {rollback})")
        self.reason, self.switch, self.probe, self.rollback = reason, switch, probe, rollback


def roll_out(settings, target, export_dir: Path, policy_version: str,
             prompts: list[list[int]], api_key: str | None = None) -> Rollout:
    """Make ``export_dir`` live through ``target``; ``DeployRejected`` when it never served (nothing
    changed) or, after the rollback, when its health check or probe failed."""
    t0 = time.monotonic()
    waves = target.waves() if hasattr(target, "waves") else [None]
    done: list[Switch] = []
    ro = None
    for n, wave in enumerate(waves, 1):
        where = f" (wave {n}/{len(waves)}: replicas {wave})" if len(waves) > 1 else ""
        try:
            sw = target.switch(Path(export_dir), policy_version, **({"wave": wave} if wave is not None else {}))
        except Exception as e:  # noqa: BLE001 - this wave never served (a cluster error too): undo the earlier ones
            undone = target.restore(done) if done else "nothing changed; the previous deployment kept serving"
            what = str(e) if isinstance(e, DeployError) else f"{type(e).__name__}: {e}"
            raise DeployRejected(f"deploy failed{where}: {what}", None, None, undone) from e
        try:
            ro = probe_and_commit(settings, target, sw, prompts, api_key, t0)
        except DeployRejected as e:
            if not done:
                raise
            raise DeployRejected(e.reason + where, e.switch, e.probe, f"{e.rollback}; {target.restore(done)}") from e
        done.append(sw)
    ro.waves = len(waves)
    return ro


def probe_and_commit(settings, target, sw: Switch, prompts: list[list[int]], api_key: str | None = None,
                     t0: float | None = None) -> Rollout:
    """The second half of ``roll_out``: health check and parity probe of every new server of a
    switched deployment, then commit; any failure (the commit's included) rolls back and raises
    ``DeployRejected``."""
    t0 = time.monotonic() - sw.seconds if t0 is None else t0
    servers = [(f"replica {s['slot']} ({s['url']})", s["url"]) for s in sw.detail.get("slots") or [] if s.get("url")] \
        or [("", sw.endpoint)]
    probe, step = None, "health check / probe"
    try:
        for _, url in servers:
            if url:
                wait_healthy(url, min(settings.deploy.health_timeout_s, 60.0), api_key=api_key)
        if settings.deploy.probe_prompts and prompts:
            probes = parity_probes(settings, Path(sw.export_dir), prompts[: settings.deploy.probe_prompts],
                                   [url for _, url in servers], sw.served_model_name, api_key=api_key,
                                   seed=settings.eval.eval_seed, adapter=bool(sw.detail.get("adapter")))
            failed = [(name, p) for (name, _), p in zip(servers, probes) if not p.passed]
            if failed:
                name, probe = failed[0]
                raise DeployRejected(f"parity probe failed{' on ' + name if name else ''}: {probe.reason}", sw,
                                     probe, target.rollback(sw))
            probe = max(probes, key=lambda p: (p.mean_abs, p.p99_abs))  # the worst server of the wave
        step = "commit"
        target.commit(sw)
    except DeployRejected:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here is a failed deploy: roll back, then report
        reason = f"{step} failed: {type(e).__name__}: {e}"
        raise DeployRejected(reason, sw, probe, target.rollback(sw)) from e
    return Rollout(sw, probe, time.monotonic() - t0)


def start_canary(settings, target, export_dir: Path, policy_version: str, prompts: list[list[int]],
                 fraction: float, api_key: str | None = None) -> Rollout:
    """The candidate beside the fleet, probed like any deploy, then given ``fraction`` of trajectories;
    ``DeployRejected`` (canary stopped, the fleet untouched) when it fails its health check or probe."""
    t0 = time.monotonic()
    try:
        sw = target.switch_canary(Path(export_dir), policy_version)
    except DeployError as e:
        raise DeployRejected(f"canary failed to start: {e}", None, None, "nothing changed") from e
    probe = None
    try:
        wait_healthy(sw.endpoint, min(settings.deploy.health_timeout_s, 60.0), api_key=api_key)
        if settings.deploy.probe_prompts and prompts:
            probe = parity_probe(settings, Path(sw.export_dir), prompts[: settings.deploy.probe_prompts],
                                 sw.endpoint, sw.served_model_name, api_key=api_key, seed=settings.eval.eval_seed,
                                 adapter=bool(sw.detail.get("adapter")))
    except Exception as e:  # noqa: BLE001 - a canary that cannot serve: stopped, reported
        raise DeployRejected(f"canary health check / probe failed: {type(e).__name__}: {e}", sw, probe,
                             target.stop_canary()) from e
    if probe is not None and not probe.passed:
        raise DeployRejected(f"canary parity probe failed: {probe.reason}", sw, probe, target.stop_canary())
    try:
        target.commit_canary(sw, fraction)
    except Exception as e:  # noqa: BLE001 - a canary that could not be routed to: stopped, reported
        raise DeployRejected(f"canary commit failed: {type(e).__name__}: {e}", sw, probe, target.stop_canary()) from e
    return Rollout(sw, probe, time.monotonic() - t0)
