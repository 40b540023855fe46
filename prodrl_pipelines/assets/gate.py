"""The deployment gate: a blocking asset check in front of `deployment`."""


from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, MetadataValue, asset_check

from prodrl_pipelines.loop import gate
from prodrl_pipelines.assets.partitions import rounds_partitions
from prodrl_pipelines.assets.round import heldout_eval
from prodrl_pipelines.loop.plots import markdown_image, reward_curve_png
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, open_services
from prodrl_pipelines.loop.round_state import describe_decision, round_state
from prodrl_pipelines.loop.review import state_tags, version_description


@asset_check(asset=heldout_eval, blocking=True, partitions_def=rounds_partitions,
             description="Finite weights, the export serves, and held-out reward is not worse than the "
                         "live policy's beyond the tolerance (paired lower confidence bound).")
def deployment_gate(context: AssetCheckExecutionContext, settings: ProdRLSettings, store: StoreResource,
                    mlflow: MlflowResource) -> AssetCheckResult:
    svc = open_services(settings, store, mlflow)
    rkey = context.partition_key
    d, reproduced = gate.gate(svc, rkey)
    decision = svc.ledger.decision(rkey)
    version = svc.ledger.round_summary(rkey).get("model_version")
    run_id = svc.lineage.round_run(rkey)
    extra = {}
    if not reproduced:  # the first decision: registry, run and plot written once, never again
        if version:
            tags = state_tags(round_state(decision), decision)  # gate, then review: consistent at every write
            svc.lineage.tag_version(version, {"gate": tags["gate"], "review": tags["review"],
                                              "gate_reasons": "; ".join(d.reasons) or "none",
                                              "heldout_reward": f"{d.candidate_mean:.4f}", "round": rkey})
            svc.lineage.describe_version(version, version_description(rkey, decision))
        svc.lineage.set_tags(run_id, {"gate": "passed" if d.passed else "failed", "review": decision.get("review", "none")})
        hist = [h for h in svc.ledger.round_summaries() if "heldout_reward" in h]
        png = reward_curve_png([h["round"] for h in hist], [h["heldout_reward"] for h in hist],
                               [h.get("heldout_reward_ci", 0.0) for h in hist],
                               [bool(h.get("gate_passed", h.get("deployed"))) for h in hist])
        svc.lineage.log_bytes(run_id, png, "reward_curve.png", "plots")
        extra["reward_curve"] = MetadataValue.md(markdown_image(png, "held-out reward"))
        if not d.passed:
            svc.lineage.finish(run_id)  # the round ends here: live deployment and champion untouched
    return AssetCheckResult(
        passed=d.passed, severity=AssetCheckSeverity.ERROR,
        description=d.summary() + ("" if d.passed is False else f" -> {describe_decision(decision)}"),
        metadata={"candidate_reward": d.candidate_mean, "live_reward": d.live_mean, "mean_diff": d.mean_diff,
                  "diff_lower": d.diff_lower, "diff_upper": d.diff_upper, "tolerance": d.tolerance if d.tolerance == d.tolerance else svc.settings.eval.gate_tolerance,
                  "n_tasks": d.n_tasks, "reasons": "; ".join(d.reasons) or "none",
                  "state": round_state(decision), "reproduced": reproduced,
                  "model_version": MetadataValue.url(svc.lineage.version_url(version)) if version else "none",
                  "mlflow_run": MetadataValue.url(svc.lineage.run_url(run_id)), **extra},
    )
