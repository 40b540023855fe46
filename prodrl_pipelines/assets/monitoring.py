"""Scheduled evaluation of the live deployment: drift between rounds becomes a time series, with an
alert (a failed asset check) when the live reward drops below the deployed round's own evaluation."""

import time

from dagster import (
    AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetExecutionContext, MaterializeResult, MetadataValue,
    ScheduleDefinition, asset, define_asset_job,
)

from prodrl_pipelines.loop import monitoring
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, open_services

MONITORING_RUN = "live-monitoring"
ALERT_CHECK = "live_reward_alert"


@asset(group_name="monitoring", check_specs=[AssetCheckSpec(ALERT_CHECK, asset="live_heldout_eval",
       description="Live held-out reward within the gate tolerance of the deployed round's own evaluation")])
def live_heldout_eval(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                      mlflow: MlflowResource):
    """Held-out reward of whatever serves right now, through the serving endpoint, a fresh sample each
    time; each materialisation is one point (MLflow run `live-monitoring`: step = evaluation index)."""
    svc = open_services(settings, store, mlflow)
    run_id = svc.lineage.round_run(MONITORING_RUN)
    index = svc.lineage.metric_points(run_id, "live_heldout_reward")
    res = monitoring.evaluate_live(svc, index)
    svc.lineage.log_metrics(run_id, {"live_heldout_reward": res["heldout_reward"],
                                     "live_heldout_ci95": res["heldout_ci95"]}, index, int(time.time() * 1000))
    svc.lineage.set_tags(run_id, {"live_policy_version": res["policy_version"], "engine": res["engine"]})
    svc.lineage.finish(run_id)  # each point closes it: a series of evaluations, not a run left "running"
    ok, why = monitoring.alert(res)
    yield MaterializeResult(metadata={**res, "mlflow_run": MetadataValue.url(svc.lineage.run_url(run_id))})
    yield AssetCheckResult(check_name=ALERT_CHECK, passed=ok, severity=AssetCheckSeverity.ERROR, description=why,
                           metadata={"heldout_reward": res["heldout_reward"], "deployed_reward": res["deployed_reward"],
                                     "tolerance": res["tolerance"]})


live_eval_job = define_asset_job("live_eval", selection=[live_heldout_eval],
                                 description="Evaluate the live deployment on the held-out set.")
live_eval_schedule = ScheduleDefinition(job=live_eval_job, cron_schedule="0 */6 * * *",
                                        description="Held-out reward of the live deployment every 6 hours.")
