"""Steps 1-2 of a round: the recorded trajectories it trains on (a pinned snapshot of the store,
selected and validated) and the training batch (advantages and the minibatch plan)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from prodrl_pipelines.loop.services import (
    RoundError, Services, check_recipe_fits_deployment, refuse_if_decided, round_seed, upstream_table, vocab_size,
    moe_routing_shape,
)
from prodrl_pipelines.storage import documents, keys


def select_data(svc: Services, rkey: str) -> dict:
    from prodrl_pipelines.trajectories.selection import InsufficientDataError, select_round_dataset

    refuse_if_decided(svc, rkey, "recorded_trajectories")
    s, live = svc.settings, svc.live()
    check_recipe_fits_deployment(svc, live)
    try:
        sel = select_round_dataset(
            svc.store, rkey, live_version=live.policy_version, version_order=svc.ledger.version_order(),
            max_policy_lag=s.recipe.max_policy_lag, n_required=s.recipe.trajectories_per_round,
            vocab_size=vocab_size(live.checkpoint_dir), seed=round_seed(s, rkey),
            routing_shape=moe_routing_shape(live.checkpoint_dir), resolve_rewards=svc.rewards.resolve,
        )
    except InsufficientDataError as e:
        raise RoundError(
            f"settings steps_per_round={s.recipe.steps_per_round} x batch_size={s.recipe.batch_size} = "
            f"{s.recipe.trajectories_per_round} trajectories per round exceed the available data: {e}"
        ) from e
    ds = sel.dataset
    # the retokenized baseline (DESIGN.md s.5) rebuilds the ids from the texts, as a naive pipeline would
    replay_stats: dict = {"replay": s.recipe.replay}
    if s.recipe.replay == "retokenized":
        from transformers import AutoTokenizer

        from prodrl_pipelines.engines.reply_parsers import get_reply_parser
        from prodrl_pipelines.evaluation.suite import reply_parser
        from prodrl_pipelines.trajectories.retokenize import retokenize_calls

        # the naive pipeline keeps the API's messages: the deployment's reply parser (the suite's)
        parser = reply_parser(svc.suite)
        ds, rstats = retokenize_calls(ds, AutoTokenizer.from_pretrained(live.checkpoint_dir),
                                      parse_reply=None if parser == "none" else get_reply_parser(parser))
        replay_stats.update(rstats.as_dict())
    documents.put_table(svc.blobs, keys.dataset(rkey), ds)
    rewards = np.asarray(ds.group_by("trajectory_id").aggregate([("reward", "max")])["reward_max"])
    versions = sorted(set(ds["policy_version"].to_pylist()))
    gen_tokens = int(sum(len(x) for x in ds["output_token_ids"].to_pylist()))
    stats = {
        "live_version": live.policy_version, "data_versions": versions,
        "num_trajectories": len(rewards), "num_calls": ds.num_rows, "generated_tokens": gen_tokens,
        "eligible": sel.n_eligible, "quarantined": sel.n_quarantined,
        "quarantine_reasons": dict(sel.quarantine_counts),
        "table_versions": dict(sel.table_versions),  # the store snapshot read: re-readable by time travel
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        "reward_sources": svc.rewards.describe(),  # the sources, versions and rule the rewards came from
        **replay_stats,  # replay mode and, when retokenized, the retokenize counts
    }
    svc.ledger.update_round(rkey, num_trajectories=len(rewards), data_reward_mean=stats["reward_mean"],
                              quarantined=sel.n_quarantined, table_versions=dict(sel.table_versions))
    return stats


def in_flight_pins(svc: Services) -> list[dict]:
    """The store snapshots (table versions) read by rounds not decided yet: a vacuum keeps their files."""
    from prodrl_pipelines.loop.round_state import is_decided

    out = []
    for rkey in sorted({k.split("/")[1] for k in svc.blobs.list(keys.ROUNDS) if k.endswith("/summary.json")}):
        pin = svc.ledger.round_summary(rkey).get("table_versions")
        if pin and not is_decided(svc.ledger.decision(rkey)):
            out.append(pin)
    return out


def build_batch(svc: Services, rkey: str) -> dict:
    from prodrl_pipelines.rl.trajectory import trajectories_from_table
    from prodrl_pipelines.rl.checkpoint import load_trainer_state
    from prodrl_pipelines.rl.trainer import plan_minibatches, round_advantages

    refuse_if_decided(svc, rkey, "training_batch")
    s, live = svc.settings, svc.live()
    trajs = trajectories_from_table(upstream_table(svc, keys.dataset(rkey)))
    state = load_trainer_state(Path(live.checkpoint_dir))
    adv = round_advantages(trajs, s.recipe, state)
    plan = plan_minibatches(trajs, s.recipe, round_seed(s, rkey))
    batch = {
        "trajectory_ids": [t.trajectory_id for t in trajs],
        "advantages": adv.tolist(),
        "plan": plan,
        "baseline_state": asdict(state.baseline),
        "recipe": s.recipe.model_dump(),
    }
    documents.put_json(svc.blobs, keys.batch(rkey), batch)
    nz = float(np.mean(adv != 0))
    return {
        "steps": len(plan), "batch_size": s.recipe.batch_size, "baseline": s.recipe.baseline,
        "adv_mean": float(adv.mean()), "adv_std": float(adv.std()), "adv_nonzero_frac": nz,
        "generated_tokens_per_traj": float(np.mean([t.num_generated for t in trajs])),
    }
