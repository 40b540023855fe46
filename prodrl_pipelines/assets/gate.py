"""The deployment gate: a blocking asset check in front of `deployment`."""


from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, MetadataValue, asset_check

from prodrl_pipelines.loop import gate
from prodrl_pipelines.assets.partitions import rounds_partitions
from prodrl_pipelines.assets.round import heldout_eval
from prodrl_pipelines.loop import lineage_hooks
from prodrl_pipelines.loop.plots import markdown_image
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, open_services
from prodrl_pipelines.loop.round_state import describe_decision, round_state


@asset_check(asset=heldout_eval, blocking=True, partitions_def=rounds_partitions,
             description="Finite weights, the export serves, and held-out reward is not worse than the "
                         "live policy's beyond the tolerance (paired lower confidence bound).")
def deployment_gate(context: AssetCheckExecutionContext, settings: ProdRLSettings, store: StoreResource,
                    mlflow: MlflowResource) -> AssetCheckResult:
    svc = open_services(settings, store, mlflow)
    rkey = context.partition_key
    d, reproduced = gate.gate(svc, rkey)
    rec = lineage_hooks.record_gate(svc, rkey, d, reproduced)
    decision, version, run_id = svc.ledger.decision(rkey), rec["version"], rec["run_id"]
    extra = {"reward_curve": MetadataValue.md(markdown_image(rec["png"], "held-out reward"))} if rec["png"] else {}
    return AssetCheckResult(
        passed=d.passed, severity=AssetCheckSeverity.ERROR,
        description=d.summary() + ("" if d.passed is False else f" -> {describe_decision(decision)}"),
        metadata={"candidate_reward": d.candidate_mean, "live_reward": d.live_mean, "mean_diff": d.mean_diff,
                  "diff_lower": d.diff_lower, "diff_upper": d.diff_upper, "tolerance": d.tolerance if d.tolerance == d.tolerance else svc.settings.eval.gate_tolerance,
                  "n_tasks": d.n_tasks, "reasons": "; ".join(d.reasons) or "none",
                  "warnings": "; ".join(d.warnings) or "none",
                  "state": round_state(decision), "reproduced": reproduced,
                  "model_version": MetadataValue.url(svc.lineage.version_url(version)) if version else "none",
                  "mlflow_run": MetadataValue.url(svc.lineage.run_url(run_id)), **extra},
    )
