"""Step 0 of a round: reward the window's recorded trajectories that lack a reward from the
configured scorers (grader, judge), so selection can use them; and re-scoring stored trajectories.
Only complete episodes are scored (``rewards.completion``); those under way are counted ``in_flight``.
``runner`` says where the sources run (``rewards.runners``: here, or a Ray Data actor pool)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.loop.services import Services, refuse_if_decided
from prodrl_pipelines.storage import documents, keys


def window_calls(svc: Services, rkey: str | None = None) -> pa.Table:
    """The live policy window's calls of trajectories no other round has consumed."""
    from prodrl_pipelines.trajectories.rows import policy_window

    live = svc.live()
    window = policy_window(live.policy_version, svc.ledger.version_order(), svc.settings.recipe.max_policy_lag)
    calls = svc.store.read_calls(window, columns=["task_id", "prompt_text", "output_text", "created_at"])
    ids = pc.unique(calls.column("trajectory_id")).to_pylist()
    used = svc.store.used_trajectory_ids(exclude_round=rkey, trajectory_ids=ids)
    if used:
        calls = calls.filter(pc.invert(pc.is_in(calls.column("trajectory_id"), value_set=pa.array(sorted(used), pa.string()))))
    return calls


def score_missing_now(svc: Services, rkey: str | None = None, runner=None) -> dict:
    """Score what the live window's unconsumed trajectories lack (idempotent): per-source counts
    and the rewards each scored. ``rkey``: a round's own ledger rows do not count as consumed."""
    from prodrl_pipelines.rewards.runners import LOCAL
    from prodrl_pipelines.rewards.scoring import score_missing

    calls = window_calls(svc, rkey)
    reports = score_missing(svc.store, svc.rewards, calls, runner=runner or LOCAL)
    return {"trajectories": len(pc.unique(calls.column("trajectory_id"))), "rule": svc.rewards.describe(),
            "in_flight": max((r.in_flight for r in reports.values()), default=0),
            "sources": {n: r.as_dict() for n, r in reports.items()},
            "rewards": {n: r.rewards for n, r in reports.items()}}


def score_round(svc: Services, rkey: str, runner=None) -> dict:
    """``score_missing_now`` for a round, stored beside it (``keys.scoring``)."""
    refuse_if_decided(svc, rkey, "scored_rewards")
    out = score_missing_now(svc, rkey, runner)
    documents.put_json(svc.blobs, keys.scoring(rkey), out)
    return out


def rescore(svc: Services, source: str, versions: list[str] | None = None, runner=None):
    from prodrl_pipelines.rewards.runners import LOCAL
    from prodrl_pipelines.rewards.scoring import rescore as _rescore

    return _rescore(svc.store, svc.rewards, source, versions, runner or LOCAL)
