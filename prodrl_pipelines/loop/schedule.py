"""When the next round starts: the previous one decided, and S*B eligible trajectories recorded."""

from __future__ import annotations

from prodrl_pipelines.loop.round_state import BASE_VERSION, round_index
from prodrl_pipelines.loop.services import Services, vocab_size


def next_round_decision(svc: Services, existing_rounds: list[str], in_flight: bool) -> tuple[str | None, str]:
    """(round key to start, reason). Starts round k+1 only when round k is decided (a pending review
    waits) and S*B eligible data exists; each reason says what would unblock it."""
    from prodrl_pipelines.loop.round_state import round_key
    from prodrl_pipelines.loop.round_state import CANARY, PENDING_REVIEW, round_state
    from prodrl_pipelines.trajectories.selection import count_eligible

    live = svc.ledger.live()
    if live is None:
        return None, "no live deployment yet: materialise base_policy (the bootstrap job) or run `prodrl bootstrap`"
    if in_flight:
        return None, "a round is in flight; the next one starts when it has finished"
    rounds_only = [k for k in existing_rounds if k != BASE_VERSION]
    latest = max(rounds_only, key=round_index) if rounds_only else None
    state = round_state(svc.ledger.decision(latest)) if latest else None
    if latest is not None and state == "running":
        return None, f"{latest} has not finished (no gate decision yet); re-execute its failed run to resume it"
    if state == CANARY:
        from prodrl_pipelines.loop import canary

        return None, (f"{latest} is a canary on live traffic ({canary.judge(svc, latest).summary()}); the next "
                      "round starts once it is promoted or removed")
    if state == PENDING_REVIEW:
        mv = svc.ledger.round_summary(latest).get("model_version", "VERSION")
        return None, (f"{latest} awaits review: approve model version {mv} (move alias champion to it, tag "
                      f"review=approved, or `prodrl review approve {mv}`) or reject it (tag review=rejected, or "
                      f"`prodrl review reject {mv} --reason ...`)")
    need = svc.settings.recipe.trajectories_per_round
    scored = bool(svc.settings.rewards.scorers)  # a grader or judge rewards stored traffic itself
    tick = count_eligible(svc.store, live.policy_version, svc.ledger.version_order(),
                          svc.settings.recipe.max_policy_lag, vocab_size(live.checkpoint_dir),
                          needs_reward=not scored, report=True)
    n = tick.eligible
    if n < need:
        what = "recorded trajectories (scored by " + ", ".join(svc.settings.rewards.scorers) + ")" if scored \
            else "rewarded trajectories"
        # what the store holds says where traffic stops: not recorded, not rewarded, or not eligible
        seen = f"; the store holds {tick.recorded} trajectories of the window, {tick.rewarded} rewarded"
        return None, (f"{n}/{need} eligible {what} from {live.policy_version}: send {need - n} more "
                      f"{what.split(' (')[0]} through the recorder{seen}")
    nxt = round_key((round_index(latest) if latest else 0) + 1)
    return nxt, f"{n} eligible trajectories >= S*B = {need}"
