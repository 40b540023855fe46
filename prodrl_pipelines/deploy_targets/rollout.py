"""One deploy, start to finish: switch, health check, parity probe, then commit or roll back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import DeployError, Switch, wait_healthy
from prodrl_pipelines.deploy_targets.probe import ProbeResult, parity_probe


@dataclass
class Rollout:
    switch: Switch
    probe: ProbeResult | None
    seconds: float  # from "deploy" to "probe passed" (and committed)

    def metadata(self) -> dict:
        out = {**self.switch.summary(), "deploy_seconds": round(self.seconds, 3)}
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
    try:
        sw = target.switch(Path(export_dir), policy_version)
    except DeployError as e:  # never served: nothing to undo
        raise DeployRejected(f"deploy failed: {e}", None, None, "nothing changed; the previous deployment kept serving") from e
    return probe_and_commit(settings, target, sw, prompts, api_key, t0)


def probe_and_commit(settings, target, sw: Switch, prompts: list[list[int]], api_key: str | None = None,
                     t0: float | None = None) -> Rollout:
    """The second half of ``roll_out``: health check and parity probe of a switched deployment, then
    commit, or roll back and raise ``DeployRejected``."""
    t0 = time.monotonic() - sw.seconds if t0 is None else t0
    probe = None
    try:
        if sw.endpoint:
            wait_healthy(sw.endpoint, min(settings.deploy.health_timeout_s, 60.0), api_key=api_key)
        if settings.deploy.probe_prompts and prompts:
            probe = parity_probe(settings, Path(sw.export_dir), prompts[: settings.deploy.probe_prompts],
                                 sw.endpoint, sw.served_model_name, api_key=api_key, seed=settings.eval.eval_seed)
    except Exception as e:  # noqa: BLE001 - any failure here is a failed deploy: roll back, then report
        reason = f"health check / probe failed: {type(e).__name__}: {e}"
        raise DeployRejected(reason, sw, probe, target.rollback(sw)) from e
    if probe is not None and not probe.passed:
        raise DeployRejected(f"parity probe failed: {probe.reason}", sw, probe, target.rollback(sw))
    target.commit(sw)
    return Rollout(sw, probe, time.monotonic() - t0)
