"""The deployment gate: a blocking asset check in front of `deployment`."""


from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, asset_check

from prodrl_pipelines import rounds
from prodrl_pipelines.assets.partitions import rounds_partitions
from prodrl_pipelines.assets.round import heldout_eval
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, services


@asset_check(asset=heldout_eval, blocking=True, partitions_def=rounds_partitions,
             description="Finite weights, the export serves, and held-out reward is not worse than the "
                         "live policy's beyond the tolerance (paired lower confidence bound).")
def deployment_gate(context: AssetCheckExecutionContext, settings: ProdRLSettings, store: StoreResource,
                    mlflow: MlflowResource) -> AssetCheckResult:
    svc = services(settings, store, mlflow)
    rkey = context.partition_key
    d = rounds.gate(svc, rkey)
    version = svc.registry.round_summary(rkey).get("model_version")
    if version:
        svc.lineage.tag_version(version, {"gate": "passed" if d.passed else "failed",
                                          "gate_reasons": "; ".join(d.reasons) or "none",
                                          "heldout_reward": f"{d.candidate_mean:.4f}", "round": rkey})
    run_id = svc.lineage.round_run(rkey)
    svc.lineage.set_tags(run_id, {"gate": "passed" if d.passed else "failed"})
    if not d.passed:
        svc.lineage.finish(run_id)  # the round ends here: live deployment and champion untouched
    return AssetCheckResult(
        passed=d.passed, severity=AssetCheckSeverity.ERROR,
        description=d.summary(),
        metadata={"candidate_reward": d.candidate_mean, "live_reward": d.live_mean, "mean_diff": d.mean_diff,
                  "diff_lower": d.diff_lower, "diff_upper": d.diff_upper, "tolerance": svc.settings.eval.gate_tolerance,
                  "reasons": "; ".join(d.reasons) or "none"},
    )
