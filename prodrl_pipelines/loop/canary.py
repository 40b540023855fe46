"""A canary on live traffic: a round that passed its gate (and its review) serves a sticky fraction of
trajectories (``deploy.canary_fraction``) beside the champion before it takes all of them.

Judged once the candidate has ``deploy.canary_min_trajectories`` rewarded trajectories: the mean
live reward of the candidate's trajectories against the champion's recorded in the same window
(since the canary started), with the gate's one-sided normal bound on the unpaired difference
(``eval.gate_z``, ``eval.gate_tolerance``): pass iff mean(candidate) - mean(champion) - z * se >=
-tolerance, se = sqrt(var_c / n_c + var_l / n_l). Pass: a full rolling update to the candidate.
Fail: the canary is removed, the round is decided (not deployed, ``canary: failed``), and the next
round trains from the live policy. A reviewer may end it early either way (``prodrl review``).

The rewards are the ones a round would train on: the configured plan (``RewardPlan.resolve``: its
sources, pinned versions and combination rule), never whatever row came last. With scorers in the
plan (grader, judge) the window's complete trajectories are scored (``score_completed``) by a run
of its own that the canary sensor requests (one at a time, the last one's report kept beside the
round: ``record_scoring``), as a round's ``scored_rewards`` would score them; no round runs while a
canary does, so nothing else would. The sensor's tick only judges what is recorded: a slow or hung
judge holds a scoring run (bounded by ``deploy.canary_scoring_budget_s`` and the judge's breaker),
never the tick.

A verdict, once acted on, is final: a pass is recorded on the round (``record_promotion``) before
the rollout is requested, the rollout deploys with that recorded verdict, and a recorded pass can no
longer be failed (``VerdictFinal``); a failure decides the round at once, and a decided round can no
longer be promoted (``promotion.deploy`` refuses).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.loop.services import RoundError, Services

RUNNING, PASSED, FAILED = "running", "passed", "failed"
# a reviewer ends a canary early on its model version: promote (full rollout now) or fail (remove it)
END_TAG, END_BY_TAG = "canary_end", "canary_end_by"


@dataclass
class CanaryVerdict:
    passed: bool | None  # None: not enough rewarded candidate trajectories yet
    candidate_mean: float
    champion_mean: float
    n_candidate: int
    n_champion: int
    diff: float
    diff_lower: float
    tolerance: float
    needed: int
    ended_by: str = "live reward"

    def summary(self) -> str:
        if self.passed is None:
            return f"{self.n_candidate}/{self.needed} rewarded candidate trajectories"
        return (f"canary {'passed' if self.passed else 'failed'} ({self.ended_by}): live reward "
                f"{self.candidate_mean:.4f} on {self.n_candidate} trajectories vs champion {self.champion_mean:.4f} on "
                f"{self.n_champion}; difference {self.diff:+.4f}, lower bound {self.diff_lower:+.4f} "
                f"(tolerance {self.tolerance:.4f})")

    def tags(self) -> dict[str, str]:
        """The numbers a reviewer sees on the model version."""
        return {"canary_reward": f"{self.candidate_mean:.4f}", "canary_champion_reward": f"{self.champion_mean:.4f}",
                "canary_trajectories": str(self.n_candidate), "canary_champion_trajectories": str(self.n_champion),
                "canary_lower_bound": f"{self.diff_lower:+.4f}"}


def unpaired_lower_bound(candidate: np.ndarray, champion: np.ndarray, z: float) -> tuple[float, float]:
    """(mean difference, its one-sided lower bound) of two independent samples (normal approximation)."""
    c, ch = np.asarray(candidate, np.float64), np.asarray(champion, np.float64)
    diff = float(c.mean() - ch.mean())
    var = (c.var(ddof=1) / c.size if c.size > 1 else 0.0) + (ch.var(ddof=1) / ch.size if ch.size > 1 else 0.0)
    return diff, diff - z * math.sqrt(var)


class VerdictFinal(RoundError):
    """The canary's verdict was acted on already (its promotion is recorded): it is not judged again."""


def window_calls(svc: Services, candidate: str, champion: str, since_us: int, columns=()) -> pa.Table:
    """The calls each version served since ``since_us`` (epoch microseconds)."""
    calls = svc.store.read_calls([candidate, champion], columns=["created_at", *columns])
    return calls.filter(pc.greater_equal(pc.cast(calls["created_at"], "int64"), since_us))


def window_rewards(svc: Services, candidate: str, champion: str, since_us: int) -> tuple[np.ndarray, np.ndarray]:
    """The rewards a round would train on (``RewardPlan.resolve``) of the trajectories each version
    served since ``since_us``: the candidate's (all of its traffic is the canary's) and the champion's
    in the same window."""
    calls = window_calls(svc, candidate, champion, since_us)
    by_version: dict[str, set[str]] = {candidate: set(), champion: set()}
    for tid, v in zip(calls["trajectory_id"].to_pylist(), calls["policy_version"].to_pylist()):
        by_version[v].add(tid)
    both = by_version[candidate] & by_version[champion]  # an episode that crossed versions judges neither
    ids = (by_version[candidate] | by_version[champion]) - both
    rows = svc.store.read_rewards(latest=False, trajectory_ids=sorted(ids)) if ids else None
    resolved = svc.rewards.resolve(rows) if rows is not None and rows.num_rows else None
    got = (dict(zip(resolved["trajectory_id"].to_pylist(), resolved["reward"].to_pylist()))
           if resolved is not None else {})
    pick = lambda v: np.asarray([got[i] for i in sorted(by_version[v] - both) if i in got and got[i] is not None  # noqa: E731
                                 and math.isfinite(got[i])], np.float64)
    return pick(candidate), pick(champion)


def score_completed(svc: Services, rkey: str, now_us: int | None = None, budget_s: float | None = None) -> dict:
    """Score, with the plan's scorers, the complete trajectories the canary's window lacks a reward
    for (both versions; idempotent, ``rewards.scoring.score_missing``): trajectories, in_flight and
    per-source counts. Nothing to do when the plan has no scorer. ``budget_s``: no judge attempt runs
    past it (what is left stays unscored for the next pass), so a hung judge cannot hold a sensor tick."""
    import time

    from prodrl_pipelines.rewards.scoring import score_missing

    if not svc.settings.rewards.scorers:
        return {"trajectories": 0, "in_flight": 0, "sources": {}}
    d = svc.ledger.decision(rkey)
    calls = window_calls(svc, rkey, svc.ledger.live().policy_version, int(d["canary_started_us"]),
                         columns=["task_id", "prompt_text", "output_text"])
    bounded = [src for src in svc.rewards.sources.values() if hasattr(src, "deadline")]
    for src in bounded:
        src.deadline = None if budget_s is None else time.monotonic() + budget_s
    try:
        reports = score_missing(svc.store, svc.rewards, calls, now_us)
    finally:
        for src in bounded:
            src.deadline = None
    return {"trajectories": len(pc.unique(calls.column("trajectory_id"))),
            "in_flight": max((r.in_flight for r in reports.values()), default=0),
            "sources": {n: r.as_dict() for n, r in reports.items()}}


def record_scoring(svc: Services, rkey: str, report: dict, run_id: str = "") -> dict:
    """Keep a scoring run's report beside the round (the sensor's skip message and the UI read it)."""
    from datetime import datetime, timezone

    from prodrl_pipelines.storage import documents, keys

    doc = {**report, "run_id": run_id, "at": datetime.now(timezone.utc).isoformat()}
    documents.put_json(svc.blobs, keys.canary_scoring(rkey), doc)
    return doc


def last_scoring(svc: Services, rkey: str) -> dict | None:
    from prodrl_pipelines.storage import documents, keys

    key = keys.canary_scoring(rkey)
    return documents.get_json(svc.blobs, key) if svc.blobs.exists(key) else None


def scoring_summary(report: dict | None) -> str:
    """What the last scoring run left unscored and why (a hung judge: its breaker, the budget); '' when
    nothing failed."""
    if not report:
        return ""
    return "; ".join(f"{n} left {r['failed']} unscored: {r['first_error']}"
                     for n, r in report.get("sources", {}).items() if r.get("failed") and r.get("first_error"))


def judge(svc: Services, rkey: str) -> CanaryVerdict:
    """The canary of ``rkey`` on the rewards recorded so far (``passed`` None: too few yet)."""
    s, d = svc.settings, svc.ledger.decision(rkey)
    live = svc.ledger.live()
    cand, champ = window_rewards(svc, rkey, live.policy_version, int(d["canary_started_us"]))
    need = s.deploy.canary_min_trajectories
    if cand.size < need or champ.size < 2:
        return CanaryVerdict(None, float(cand.mean()) if cand.size else math.nan,
                             float(champ.mean()) if champ.size else math.nan, int(cand.size), int(champ.size),
                             math.nan, math.nan, s.eval.gate_tolerance, need)
    diff, lower = unpaired_lower_bound(cand, champ, s.eval.gate_z)
    return CanaryVerdict(lower >= -s.eval.gate_tolerance, float(cand.mean()), float(champ.mean()), int(cand.size),
                         int(champ.size), diff, lower, s.eval.gate_tolerance, need)


def paused(svc: Services) -> str | None:
    """Why the recorder took the running canary off traffic (its server kept refusing connections),
    else None. Its verdict waits ``deploy.canary_pause_grace_s`` (the recorder resumes a canary whose
    server answers again); still paused after that, it is failed with this reason."""
    from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file

    ep = endpoint_file(svc.settings.home_path, svc.settings.deploy).read()
    return ep.canary_paused() if ep is not None else None


def paused_for_s(svc: Services) -> float:
    """Seconds since the recorder paused the running canary (0 when it is not paused)."""
    from datetime import datetime, timezone

    from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file

    ep = endpoint_file(svc.settings.home_path, svc.settings.deploy).read()
    at = ep.canary_paused_at() if ep is not None else None
    return max(0.0, (datetime.now(timezone.utc) - at).total_seconds()) if at is not None else 0.0


def running_canary(svc: Services) -> str | None:
    """The round whose canary is running, if any (at most one: rounds run one at a time)."""
    from prodrl_pipelines.loop.round_state import CANARY, round_key, round_state

    for summary in reversed(svc.ledger.round_summaries()):
        rkey = round_key(int(summary["round"]))
        if round_state(svc.ledger.decision(rkey)) == CANARY:
            return rkey
    return None


def acted_verdict(svc: Services, rkey: str) -> CanaryVerdict | None:
    """The pass recorded when the canary's promotion was requested (``record_promotion``), if any."""
    d = svc.ledger.decision(rkey)
    return CanaryVerdict(**d["canary_verdict"]) if d.get("canary_promotion") else None


def promotion_by(svc: Services, rkey: str) -> dict:
    """Who asked for the canary's promotion and when (``{"by", "at"}``; empty when nobody has)."""
    return dict(svc.ledger.decision(rkey).get("canary_promotion") or {})


def record_promotion(svc: Services, rkey: str, verdict: CanaryVerdict, by: str) -> CanaryVerdict:
    """Record the pass the canary's promotion acts on, before the rollout is requested; from here on
    the verdict is final. Idempotent: a recorded pass is returned unchanged, never overwritten."""
    from prodrl_pipelines.loop.round_state import CANARY, describe_decision, round_state, utc_now

    d = svc.ledger.decision(rkey)
    if d.get("canary_promotion"):
        return CanaryVerdict(**d["canary_verdict"])
    if round_state(d) != CANARY or not verdict.passed:
        raise RoundError(f"cannot promote the canary of {rkey}: {describe_decision(d)}"
                         + ("" if verdict.passed else f"; {verdict.summary()}"))
    svc.ledger.record_decision(rkey, {**d, "canary_verdict": asdict(verdict),
                                      "canary_promotion": {"by": by, "at": utc_now()}})
    return verdict


def fail(svc: Services, rkey: str, verdict: CanaryVerdict, by: str) -> dict:
    """End a failed canary: no more traffic to it, the round decided (not deployed); champion unchanged.
    Refused (``VerdictFinal``) once its promotion is recorded."""
    from prodrl_pipelines.deploy_targets import make_target
    from prodrl_pipelines.loop.round_state import utc_now

    acted = promotion_by(svc, rkey)
    if acted:
        raise VerdictFinal(f"the canary of {rkey} passed and its rollout was requested by {acted['by']} at "
                           f"{acted['at']}: that verdict is final")
    stopped = make_target(svc.settings).stop_canary()
    decision = {**svc.ledger.decision(rkey), "canary": FAILED, "deployed": False, "decided_by": by,
                "decided_at": utc_now(), "canary_verdict": asdict(verdict), "canary_stopped": stopped}
    svc.ledger.record_decision(rkey, decision)
    svc.ledger.update_round(rkey, deployed=False, canary=FAILED, canary_reward=verdict.candidate_mean,
                            canary_champion_reward=verdict.champion_mean, decided_by=by)
    return decision
