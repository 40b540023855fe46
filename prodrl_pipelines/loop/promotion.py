"""Step 7 of a round, deployment: a round that passed its gate goes live through the deploy target
(``promotion: auto``), or waits for a reviewer's approval (``review``); a reviewer may also roll back
to an earlier deployed round. Free of Dagster, like every step in ``loop``."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from prodrl_pipelines.loop.round_state import BASE_VERSION
from prodrl_pipelines.loop.ledger import LiveDeployment
from prodrl_pipelines.loop.export import calibration_prompts
from prodrl_pipelines.loop.services import RoundError, Services, ensure_local

AUTO_DECIDER = "gate (promotion: auto)"


@dataclass
class DeployRequest:
    """A request from the registry or the canary: ``approve`` a pending round, ``rollback`` to a
    deployed one, ``canary_promote`` a round whose canary passed (or a reviewer ended it early)."""

    kind: str
    by: str
    at: str


@dataclass
class DeployOutcome:
    """``deployed`` | ``rolled_back`` | ``reproduced`` (already live: nothing changed) |
    ``awaiting_review`` (review mode: nothing deployed yet) | ``canary`` (on a slice of live traffic)."""

    kind: str
    live: LiveDeployment | None
    rollout: object | None = None


def deploy(svc: Services, rkey: str, model_version: str | None = None,
           request: DeployRequest | None = None) -> DeployOutcome:
    """Make the round's export live through the deploy target (``deploy.target``), probed for parity
    against its own checkpoint. Without a request: the auto-promotion of a round that passed its
    gate, a no-op for a pending review, the recorded result for the live round, refused otherwise.
    A failed health check or probe rolls back (the previous version keeps serving and stays live),
    is recorded on the round and raises ``DeployRejected``."""
    from prodrl_pipelines.deploy_targets.rollout import DeployRejected
    from prodrl_pipelines.loop.round_state import (
        AWAITING_DEPLOY, CANARY, DEPLOYED, PENDING_REVIEW, describe_decision, utc_now, version_state,
    )

    decision = svc.ledger.decision(rkey)
    state = version_state(rkey, decision)
    live = svc.ledger.live()
    is_live = live is not None and live.policy_version == rkey
    kind = request.kind if request else None
    if kind == "rollback":
        if state != DEPLOYED:
            raise RoundError(f"cannot roll back to {rkey}: it was never deployed ({describe_decision(decision)})")
        if is_live:
            return DeployOutcome("reproduced", live)
        dep, rollout = make_live(svc, rkey, model_version, kind="rollback", by=request.by)
        return DeployOutcome("rolled_back", dep, rollout)
    if kind is None and state == DEPLOYED and is_live:
        return DeployOutcome("reproduced", live)
    if kind is None and state == PENDING_REVIEW:
        return DeployOutcome("awaiting_review", live)
    if kind is None and state == CANARY:
        return DeployOutcome("canary", live)
    if kind == "canary_promote" and state != CANARY:
        raise RoundError(f"cannot promote the canary of {rkey}: {describe_decision(decision)}")
    if kind is None and state == DEPLOYED:
        raise RoundError(f"{rkey} is decided ({describe_decision(decision)}) and {live.policy_version if live else 'another version'} "
                         f"is live now; to roll back to it, move the registry alias champion to its model version "
                         f"({model_version or '?'}) or run `prodrl review rollback {model_version or 'VERSION'}`")
    if kind is None and state != AWAITING_DEPLOY:
        raise RoundError(f"{rkey} is decided ({describe_decision(decision)}); refusing to deploy it")
    if kind == "approve" and state != PENDING_REVIEW:
        raise RoundError(f"cannot approve {rkey}: {describe_decision(decision)}")
    by, at = (request.by, request.at) if request else (AUTO_DECIDER, utc_now())
    review = "approved" if kind == "approve" else decision.get("review", "none")
    decided = {**decision, "review": review, "decided_by": by, "decided_at": at}
    if kind != "canary_promote" and svc.settings.deploy.canary_fraction > 0:
        return _start_canary(svc, rkey, decided)
    if kind == "canary_promote":  # the verdict the request acted on, recorded before it; never a new one
        from prodrl_pipelines.loop import canary

        acted = canary.acted_verdict(svc, rkey)
        if acted is None:
            raise RoundError(f"cannot promote the canary of {rkey}: no pass was recorded to act on "
                             f"(the canary sensor records it before it requests the rollout)")
        decided = {**decided, "canary": canary.PASSED, "canary_verdict": asdict(acted)}
    try:
        dep, rollout = make_live(svc, rkey, model_version, by=by)
    except DeployRejected as e:
        probe = e.probe.metrics() if e.probe is not None else {}
        svc.ledger.record_decision(rkey, {**decided, "deployed": False, "deploy_failed": e.reason,
                                            "rolled_back": e.rollback, **probe})
        svc.ledger.update_round(rkey, deployed=False, deploy_failed=e.reason, review=review, **probe)
        raise
    if kind == "canary_promote":  # every replica serves it now: the canary's own server goes
        from prodrl_pipelines.deploy_targets import make_target

        make_target(svc.settings).stop_canary()
    svc.ledger.record_decision(rkey, {**decided, "deployed": True})
    svc.ledger.update_round(rkey, deployed=True, policy_version=rkey, review=review, decided_by=by,
                              decided_at=at, **rollout.metadata())
    return DeployOutcome("deployed", dep, rollout)


def _start_canary(svc: Services, rkey: str, decided: dict) -> DeployOutcome:
    """The round's export on the canary server, probed, given ``canary_fraction`` of trajectories."""
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.deploy_targets import make_target
    from prodrl_pipelines.deploy_targets.rollout import DeployRejected, start_canary

    s = svc.settings
    n = s.deploy.probe_prompts
    prompts = calibration_prompts(svc, rkey, n) if n else []
    fraction = s.deploy.canary_fraction
    started_us = time.time_ns() // 1000  # the recorder stamps calls (created_at) on the same clock
    try:
        rollout = start_canary(s, make_target(s), ensure_local(svc, "exports", rkey), rkey, prompts, fraction,
                               api_key=environment.deploy_api_key())
    except DeployRejected as e:
        probe = e.probe.metrics() if e.probe is not None else {}
        svc.ledger.record_decision(rkey, {**decided, "deployed": False, "deploy_failed": e.reason,
                                          "rolled_back": e.rollback, **probe})
        svc.ledger.update_round(rkey, deployed=False, deploy_failed=e.reason, **probe)
        raise
    svc.ledger.record_decision(rkey, {**decided, "canary": "running", "canary_fraction": fraction,
                                      "canary_started_us": started_us})
    svc.ledger.update_round(rkey, canary="running", canary_fraction=fraction, **rollout.metadata())
    return DeployOutcome("canary", svc.ledger.live(), rollout)


def make_live(svc: Services, version: str, model_version: str | None = None, kind: str = "deploy", by: str = ""):
    """Switch the deployment to ``version``'s export, probe it, then move the live pointer."""
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.deploy_targets import make_target
    from prodrl_pipelines.deploy_targets.rollout import roll_out

    s = svc.settings
    export_dir = ensure_local(svc, "exports", version)
    ensure_local(svc, "checkpoints", version)  # a rollback trains the next round from it
    n = s.deploy.probe_prompts
    prompts = calibration_prompts(svc, version if version != BASE_VERSION else None, n) if n else []
    rollout = roll_out(s, make_target(s), export_dir, version, prompts, api_key=environment.deploy_api_key())
    dep = LiveDeployment(policy_version=version, checkpoint_dir=str(s.checkpoints_root / version),
                         export_dir=str(s.exports_root / version), model_version=model_version, kind=kind,
                         decided_by=by)
    svc.ledger.deploy(dep)
    return dep, rollout
