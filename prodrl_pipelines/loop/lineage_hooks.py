"""What each step of a round writes to MLflow: metrics, plots, the model version's state tags and
description, aliases. Each asset calls its step, then its hook here (round 0 does both in
``bootstrap``), so the registry reads the same whoever runs the step.

Tags on a model version are written gate -> review -> deployed (``review.state_tags``): every prefix
of a transition is a consistent state.
"""

from __future__ import annotations

import json

from prodrl_pipelines.loop.plots import mismatch_history_png, reward_curve_png, reward_distribution_png, routing_png
from prodrl_pipelines.loop.review import state_tags, version_description
from prodrl_pipelines.loop.round_state import RUNNING, round_state
from prodrl_pipelines.loop.services import Services, publish_export
from prodrl_pipelines.loop.train import training_history

# per-step training metrics whose round means go on the asset
STEP_MEANS = ("engine_mismatch", "staleness", "staleness_steps", "net_mismatch", "kl", "head_entropy", "grad_norm",
              "is_weight_mean", "is_truncated_frac", "ppo_clip_frac")


def numeric(d: dict) -> dict:
    """The finite numbers of ``d`` (what MLflow metrics accept)."""
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and v == v and abs(v) != float("inf")}


def training_run(svc: Services, rkey: str) -> str:
    """The round's MLflow run, with the recipe and deploy settings as parameters (steps log into it)."""
    return svc.lineage.round_run(rkey, params={**svc.settings.recipe.model_dump(), **svc.settings.deploy.model_dump()})


def record_scoring(svc: Services, rkey: str, stats: dict) -> dict:
    """Per-source counts as metrics of the round's run and the scored rewards' histogram;
    returns ``{"run_id", "png"}``."""
    run_id = training_run(svc, rkey)
    png = reward_distribution_png(stats["rewards"])
    svc.lineage.log_bytes(run_id, png, "scored_rewards.png", "plots")
    metrics = {}
    for name, r in stats["sources"].items():
        metrics.update({f"scoring_{name}_{k}": r[k] for k in ("scored", "pending", "failed", "already", "skipped")})
        metrics[f"scoring_{name}_reward_mean"] = r["reward_mean"]
    svc.lineage.log_metrics(run_id, numeric(metrics), 0)
    return {"run_id": run_id, "png": png}


ROUND_METRIC_PREFIXES = ("layout_", "routing_", "mismatch_replay_", "mismatch_no_replay_")


def record_training(svc: Services, rkey: str, run_id: str, stats: dict) -> dict:
    """The mismatch history plot (and, for MoE data with recorded routing, the routing plot) and the
    round's means; returns ``{"png", "routing_png", "means"}``."""
    steps = [m for m in stats["steps"] if not m.get("skipped")]
    history, starts = training_history(svc)
    png = mismatch_history_png(history, starts)
    svc.lineage.log_bytes(run_id, png, "mismatch.png", "plots")
    routing = None
    if "routing_disagreement" in stats:
        routing = routing_png(stats)
        svc.lineage.log_bytes(run_id, routing, "routing.png", "plots")
    svc.lineage.log_metrics(run_id, {"round_mismatch_abs_logp": stats["mismatch_abs_logp"],
                                     **{k: v for k, v in stats.items() if k.startswith(ROUND_METRIC_PREFIXES)}},
                            stats["global_step"])
    means = {f"mean_{k}": float(sum(m[k] for m in steps) / len(steps)) for k in STEP_MEANS if steps and k in steps[0]}
    return {"png": png, "routing_png": routing, "means": means}


def record_export(svc: Services, rkey: str, stats: dict) -> dict:
    """The layer-error plot, the export metrics, and the export registered as the `challenger` model
    version (state tags: running); returns ``{"png", "version", "run_id"}``."""
    from pathlib import Path

    from prodrl_pipelines.quant.export import layer_error_png

    run_id = svc.lineage.round_run(rkey)
    png = layer_error_png(stats["layers"])
    svc.lineage.log_bytes(run_id, png, "export_layer_error.png", "plots")
    svc.lineage.log_metrics(run_id, {"export_compression_ratio": stats["compression_ratio"],
                                     "export_max_rel_fro_error": stats["max_rel_fro_error"], **stats["phases"]}, 0)
    version = svc.lineage.register_candidate(publish_export(svc, rkey, Path(stats["export_dir"])), run_id, rkey,
                                             {**state_tags(RUNNING), "format": stats["format"],
                                              "scheme": stats["scheme"], **_adapter_lineage(svc, stats)})
    svc.ledger.update_round(rkey, model_version=version, mlflow_run_id=run_id)
    return {"png": png, "version": version, "run_id": run_id}


def _adapter_lineage(svc: Services, stats: dict) -> dict[str, str]:
    """A LoRA round's model version names the base export its adapter is served on: the base's policy
    version, its own model version in the registry and its source."""
    base = stats.get("lora_base_version")
    if not base:
        return {}
    base_model_version = svc.ledger.round_summary(base).get("model_version")
    return {"lora_base_version": base, "lora_base_model_version": str(base_model_version or ""),
            "lora_adapter": f"{stats['export_dir'].rstrip('/')}/adapter", "lora_adapter_bytes": str(stats["adapter_bytes"])}


def record_evaluation(svc: Services, rkey: str, res: dict) -> str:
    """Held-out rewards of a first evaluation as metrics (a reproduced one logs nothing); the run id."""
    run_id = svc.lineage.round_run(rkey)
    cand = res["candidate"]
    if cand is not None and not res["reproduced"]:
        svc.lineage.log_metrics(run_id, {"heldout_reward": cand["mean"], "heldout_reward_ci95": cand["ci95"],
                                         "live_heldout_reward": res["live"]["mean"]}, 0)
    return run_id


def record_gate(svc: Services, rkey: str, d, reproduced: bool) -> dict:
    """The first gate decision on the model version (gate, review tags, description), the run's tags
    and the reward curve; a failed gate ends the run. Written once: a reproduced decision writes
    nothing. Returns ``{"run_id", "version", "png"}`` (``png`` None when reproduced)."""
    decision = svc.ledger.decision(rkey)
    version = svc.ledger.round_summary(rkey).get("model_version")
    run_id = svc.lineage.round_run(rkey)
    if reproduced:
        return {"run_id": run_id, "version": version, "png": None}
    if version:
        tags = state_tags(round_state(decision), decision)  # gate, then review: consistent at every write
        svc.lineage.tag_version(version, {"gate": tags["gate"], "review": tags["review"],
                                          "gate_reasons": "; ".join(d.reasons) or "none",
                                          "gate_warnings": "; ".join(d.warnings) or "none",
                                          "heldout_reward": f"{d.candidate_mean:.4f}", "round": rkey,
                                          **monitor_tags(d.monitors),
                                          **monitor_tags(d.cumulative_monitors, ".cumulative"),
                                          **({"monitor_reference": d.reference_version} if d.reference_version else {})})
        svc.lineage.describe_version(version, version_description(rkey, decision))
    svc.lineage.set_tags(run_id, {"gate": "passed" if d.passed else "failed", "review": decision.get("review", "none")})
    svc.lineage.log_metrics(run_id, numeric({**{f"monitor_{m['name']}": m["value"] for m in d.monitors},
                                             **{f"monitor_{m['name']}_cumulative": m["value"]
                                                for m in d.cumulative_monitors}}), 0)
    hist = [h for h in svc.ledger.round_summaries() if "heldout_reward" in h]
    png = reward_curve_png([h["round"] for h in hist], [h["heldout_reward"] for h in hist],
                           [h.get("heldout_reward_ci", 0.0) for h in hist],
                           [bool(h.get("gate_passed", h.get("deployed"))) for h in hist])
    svc.lineage.log_bytes(run_id, png, "reward_curve.png", "plots")
    if not d.passed:
        svc.lineage.finish(run_id)  # the round ends here: live deployment and champion untouched
    return {"run_id": run_id, "version": version, "png": png}


def monitor_tags(monitors: list[dict], suffix: str = "") -> dict[str, str]:
    """One model-version tag per behaviour monitor: its verdict and value, as a reviewer reads them
    (``suffix=".cumulative"``: against the reference policy, named in the tag)."""
    out = {}
    for m in monitors:
        verdict = "passed" if m["passed"] else ("blocks" if m["blocking"] else "warning")
        vs = f"; vs {m['against']}" if suffix and m.get("against") else ""
        out[f"monitor.{m['name']}{suffix}"] = f"{verdict} ({m['value']:.4g}; threshold {m['threshold']:.4g}{vs})"
    return out


def champion_to_live(svc: Services) -> None:
    """Alias ``champion`` back on the version that serves (after a refused or failed change)."""
    live = svc.ledger.live()
    if live is not None and live.model_version:
        svc.lineage.promote(live.model_version)


def record_deploy_rejected(svc: Services, rkey: str, version: str | None, request, probe: dict, e) -> None:
    """A round's own deploy (or its approval) that failed its probe: recorded on the version and the
    run, which ends; champion stays on what serves."""
    if request is None or request.kind == "approve":
        failed = {"deployed": "false", "deploy_failed": e.reason[:4000], "rolled_back": e.rollback[:4000]}
        run_id = svc.lineage.round_run(rkey)
        svc.lineage.log_metrics(run_id, probe, 0)
        if version:
            svc.lineage.tag_version(version, {**({"review": "approved"} if request else {}), **failed})
        svc.lineage.set_tags(run_id, failed)
        svc.lineage.finish(run_id)
    champion_to_live(svc)


def record_deployment(svc: Services, rkey: str, version: str | None, request, out, meta: dict) -> None:
    """A deploy: the version tagged deployed (review before deployed), promoted to champion and
    described, the run ended; a rollback: an event tag beside the version's history, champion moved."""
    dep = out.live
    if out.kind == "deployed":
        run_id = svc.lineage.round_run(rkey)
        svc.lineage.log_metrics(run_id, numeric(meta), 0)
        if version:
            svc.lineage.tag_version(version, {**({"review": "approved"} if request else {}), "deployed": "true",
                                              "deploy_target": meta["target"], "decided_by": dep.decided_by})
            svc.lineage.promote(version)
            svc.lineage.describe_version(version, version_description(rkey, svc.ledger.decision(rkey)))
        svc.lineage.set_tags(run_id, {"deployed": "true", "decided_by": dep.decided_by})
        svc.lineage.finish(run_id)
    elif out.kind == "rolled_back":
        events = svc.ledger.events()
        n = sum(1 for e in events if e["kind"] == "rollback")
        if version:  # an event beside the version's history, never over it
            svc.lineage.tag_version(version, {f"rollback.{n}": json.dumps(
                {"by": dep.decided_by, "at": dep.deployed_at, "from": events[-1]["previous"]})})
            svc.lineage.promote(version)


def record_canary(svc: Services, rkey: str, version: str | None, state: str, verdict=None) -> None:
    """The canary on the model version: ``canary`` = running | passed | failed, with its numbers
    (live reward of candidate and champion on the same window, trajectories, lower bound); a failed
    canary ends the round's run (nothing was deployed)."""
    if version:
        svc.lineage.tag_version(version, {"canary": state, **(verdict.tags() if verdict is not None else {})})
        if state != "running":
            svc.lineage.describe_version(version, version_description(rkey, svc.ledger.decision(rkey)))
    if state == "failed":
        run_id = svc.lineage.round_run(rkey)
        svc.lineage.set_tags(run_id, {"deployed": "false", "canary": "failed"})
        if verdict is not None and verdict.passed is not None:
            svc.lineage.log_metrics(run_id, numeric({"canary_reward": verdict.candidate_mean,
                                                     "canary_champion_reward": verdict.champion_mean,
                                                     "canary_lower_bound": verdict.diff_lower}), 0)
        svc.lineage.finish(run_id)
