"""What a round is: its key, and the state its decision document says it is in.

A round's decision document (``RoundLedger.decision``) is the truth; ``round_state`` reads it. The
last four states are final: a decided round's history never changes.
"""

from __future__ import annotations

from datetime import datetime, timezone

BASE_VERSION = "round-000000"


def round_key(k: int) -> str:
    return f"round-{k:06d}"


def round_index(key: str) -> int:
    if not key.startswith("round-"):
        raise ValueError(f"not a round partition key: {key!r} (expected 'round-NNNNNN')")
    return int(key.split("-", 1)[1])


# a round's states; the last five are final (a decided round's history never changes)
RUNNING, AWAITING_DEPLOY, PENDING_REVIEW, CANARY = "running", "awaiting_deploy", "pending_review", "canary"
GATE_FAILED, REJECTED, DEPLOYED, DEPLOY_FAILED = "gate_failed", "rejected", "deployed", "deploy_failed"
CANARY_FAILED = "canary_failed"
FINAL = frozenset({GATE_FAILED, REJECTED, DEPLOYED, DEPLOY_FAILED, CANARY_FAILED})


def utc_now() -> str:
    """The time stamp of decisions and events: UTC, ISO 8601, seconds."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def round_state(decision: dict | None) -> str:
    if decision is None:
        return RUNNING
    if not decision.get("passed"):
        return GATE_FAILED
    if decision.get("deployed"):
        return DEPLOYED
    if decision.get("deploy_failed"):
        return DEPLOY_FAILED
    if decision.get("canary") in ("running", "failed"):  # loop.canary: on live traffic, or removed
        return CANARY if decision["canary"] == "running" else CANARY_FAILED
    return {"rejected": REJECTED, "pending": PENDING_REVIEW}.get(decision.get("review", "none"), AWAITING_DEPLOY)


def version_state(rkey: str, decision: dict | None) -> str:
    """``round_state``, with the base policy deployed by construction (homes bootstrapped before
    round 0 had a decision document of its own)."""
    return DEPLOYED if rkey == BASE_VERSION and decision is None else round_state(decision)


def is_decided(decision: dict | None) -> bool:
    return round_state(decision) in FINAL


def describe_decision(decision: dict | None) -> str:
    """One line a person can act on: what was decided, by whom, when."""
    state = round_state(decision)
    if state == RUNNING:
        return "no gate decision yet"
    d = decision
    who = f" by {d['decided_by']}" if d.get("decided_by") else ""
    when = f" at {d['decided_at']}" if d.get("decided_at") else ""
    text = {
        GATE_FAILED: lambda: "gate failed: " + "; ".join(d.get("reasons") or ["(no reason recorded)"]),
        AWAITING_DEPLOY: lambda: "gate passed, deployment not done yet",
        PENDING_REVIEW: lambda: "gate passed, awaiting review",
        REJECTED: lambda: f"rejected{who}{when}" + (f": {d['review_reason']}" if d.get("review_reason") else ""),
        DEPLOYED: lambda: f"deployed{who}{when}",
        DEPLOY_FAILED: lambda: f"deploy failed and rolled back: {d.get('deploy_failed')}",
        CANARY: lambda: f"gate passed, canary on {d.get('canary_fraction', 0):.0%} of live trajectories",
        CANARY_FAILED: lambda: f"canary failed{who}{when}" + (
            f": live reward {d['canary_verdict']['candidate_mean']:.4f} vs champion "
            f"{d['canary_verdict']['champion_mean']:.4f}" if d.get("canary_verdict") else ""),
    }[state]()
    return text
