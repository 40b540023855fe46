"""Promotion and review: a round's state, the registry tags that mirror it, and what a reviewer's
registry edits ask for.

A round's decision document (``RoundLedger.decision``) is the truth; the MLflow model version
mirrors it in three tags, ``gate`` (pending | passed | failed | base), ``review`` (none | pending |
approved | rejected) and ``deployed`` (false | true). Tags are written gate -> review -> deployed,
so every prefix of a transition is a consistent state (``tag_problems``).

A reviewer acts in the registry, in the MLflow UI or with ``prodrl review``: moving the alias
``champion`` to a pending version or tagging it ``review=approved`` approves it, ``review=rejected``
rejects it, moving ``champion`` to an older deployed version rolls back to it. ``registry_actions``
turns the registry's state into those actions; anything contradictory becomes a refusal, written
back onto the version (``review_refused``) with the registry restored to the recorded state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prodrl_pipelines.loop.round_state import (
    BASE_VERSION, DEPLOYED, PENDING_REVIEW, RUNNING, GATE_FAILED, describe_decision, utc_now, version_state,
)

REVIEW_BY, REVIEW_REASON, REFUSED = "review_by", "review_reason", "review_refused"
ROLLBACK_BY = "rollback_by"  # on the registered model: who moved champion back (prodrl review rollback)
UNKNOWN_REVIEWER = "MLflow registry (no review_by tag)"


def state_tags(state: str, decision: dict | None = None, base: bool = False) -> dict[str, str]:
    """The model version's state tags for a round state, in write order."""
    if base:
        return {"gate": "base", "review": "none", "deployed": "true"}
    review = (decision or {}).get("review", "none")
    gate = {RUNNING: "pending", GATE_FAILED: "failed"}.get(state, "passed")
    return {"gate": gate, "review": review if gate == "passed" else "none",
            "deployed": "true" if state == DEPLOYED else "false"}


def tag_problems(tags: dict[str, str]) -> list[str]:
    """What is inconsistent among a version's state tags (empty: consistent)."""
    gate, review, deployed = tags.get("gate", "pending"), tags.get("review", "none"), tags.get("deployed", "false")
    out = []
    if deployed == "true" and gate not in ("passed", "base"):
        out.append(f"deployed with gate={gate}")
    if deployed == "true" and review in ("pending", "rejected"):
        out.append(f"deployed with review={review}")
    if review != "none" and gate != "passed":
        out.append(f"review={review} with gate={gate}")
    return out


def gate_numbers(decision: dict) -> str:
    d, nan = decision, float("nan")
    return (f"held-out reward {d.get('candidate_mean', nan):.4f} vs live {d.get('live_mean', nan):.4f} on "
            f"{d.get('n_tasks', 0)} tasks; mean paired difference {d.get('mean_diff', nan):+.4f}, lower bound "
            f"{d.get('diff_lower', nan):+.4f} (tolerance {d.get('tolerance', nan):.4f})")


def version_description(rkey: str, decision: dict) -> str:
    """The registry page's summary of a candidate: round, held-out reward against live, the gate."""
    mons = decision.get("monitors") or []
    shown = "; ".join(f"{m['name']} {'ok' if m['passed'] else ('BLOCKS' if m['blocking'] else 'warning')} "
                      f"({m['value']:.3g})" for m in mons)
    return f"{rkey}: {gate_numbers(decision)}. {describe_decision(decision)}." + (f" Monitors: {shown}." if shown else "")


@dataclass
class RegistryAction:
    """What the registry asks for: ``approve`` | ``reject`` | ``rollback`` | ``refuse``."""

    kind: str
    round: str
    version: str
    by: str = UNKNOWN_REVIEWER
    at: str = field(default_factory=utc_now)
    message: str = ""  # reject: the reviewer's reason; refuse: why
    restore: dict = field(default_factory=dict)  # refuse: tags written back
    restore_champion: bool = False  # refuse: move champion back to the live version

    def run_key(self, n_events: int) -> str:
        # a rollback to the same version later is a new action; an approval happens once per round
        return f"rollback-v{self.version}-{n_events}" if self.kind == "rollback" else f"{self.kind}-{self.round}"


def registry_actions(svc, champion: str | None = None, versions: list | None = None) -> list[RegistryAction]:
    """Compare the registry (aliases, review tags) with the recorded decisions; every difference a
    reviewer made becomes an action."""
    from prodrl_pipelines.loop.lineage import CHAMPION, ROUND_TAG

    lin = svc.lineage
    live = svc.ledger.live()
    live_mv = live.model_version if live else None
    champion = champion if champion is not None else lin.alias_version(CHAMPION)
    out: list[RegistryAction] = []
    for mv in versions if versions is not None else lin.versions():
        rkey = mv.tags.get(ROUND_TAG)
        if not rkey:
            continue
        v = str(mv.version)
        decision = svc.ledger.decision(rkey)
        base = rkey == BASE_VERSION
        state = version_state(rkey, decision)
        tag = mv.tags.get("review", "none")
        at_champion = champion == v and v != live_mv
        by = mv.tags.get(REVIEW_BY) or UNKNOWN_REVIEWER
        act = lambda kind, msg="", **kw: RegistryAction(kind, rkey, v, by, message=msg, **kw)  # noqa: E731
        if state == PENDING_REVIEW:
            if tag == "none":
                continue  # the gate's step has decided in the ledger and is still tagging the version
            if tag == "rejected" and at_champion:
                out.append(act("refuse", f"contradictory review of {rkey}: champion moved to version {v} but it is "
                               "tagged review=rejected; approve or reject, not both", restore={"review": "pending"},
                               restore_champion=True))
            elif tag == "rejected":
                out.append(act("reject", mv.tags.get(REVIEW_REASON, "")))
            elif tag == "approved" or at_champion:
                out.append(act("approve"))
            elif tag != "pending":
                out.append(act("refuse", f"review={tag!r} is not a review state (approved or rejected)",
                               restore={"review": "pending"}))
            continue
        expected = state_tags(state, decision, base)["review"]
        if tag != expected:
            why = ("its round has no gate decision yet" if state == RUNNING else
                   f"its round is decided ({describe_decision(decision)})" if not base else "it is the base policy")
            out.append(act("refuse", f"review={tag} on version {v} ignored: {why}", restore={"review": expected}))
        if at_champion:
            if state == DEPLOYED:
                rollback_by = lin.model_tags().get(ROLLBACK_BY) or UNKNOWN_REVIEWER
                out.append(RegistryAction("rollback", rkey, v, rollback_by))
            else:
                why = ("no gate decision yet" if state == RUNNING else describe_decision(decision))
                out.append(act("refuse", f"champion moved to version {v} ({rkey}), which was never deployed ({why}); "
                               "champion is back on the live version", restore_champion=True))
    return out


def apply_refusal(svc, a: RegistryAction) -> None:
    """Write the refusal onto the version and put the registry back to the recorded state."""
    from prodrl_pipelines.loop.lineage import CHAMPION

    lin = svc.lineage
    live = svc.ledger.live()
    if a.restore_champion and live is not None and live.model_version:
        lin.client.set_registered_model_alias(lin.model_name, CHAMPION, live.model_version)
    # the refusal tag comes last: whoever sees it sees the registry already restored
    lin.tag_version(a.version, {**a.restore, REFUSED: f"{a.at}: {a.message}"})


def apply_rejection(svc, a: RegistryAction) -> dict:
    """Close a pending round as rejected: decided, not deployed; the next round trains from live."""
    decision = {**svc.ledger.decision(a.round), "review": "rejected", "decided_by": a.by, "decided_at": a.at,
                "review_reason": a.message}
    svc.ledger.record_decision(a.round, decision)
    svc.ledger.update_round(a.round, review="rejected", decided_by=a.by, decided_at=a.at)
    lin = svc.lineage
    lin.tag_version(a.version, {"decided_by": a.by, "decided_at": a.at})
    lin.describe_version(a.version, version_description(a.round, decision))
    run_id = svc.ledger.round_summary(a.round).get("mlflow_run_id")
    if run_id:
        lin.set_tags(run_id, {"review": "rejected", "decided_by": a.by})
        lin.finish(run_id)
    return decision
