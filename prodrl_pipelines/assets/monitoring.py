"""Scheduled evaluation of the live deployment: drift between rounds becomes a time series."""

import time

from dagster import AssetExecutionContext, MaterializeResult, ScheduleDefinition, asset, define_asset_job

from prodrl_pipelines import rounds
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, services


@asset(group_name="monitoring")
def live_heldout_eval(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                      mlflow: MlflowResource) -> MaterializeResult:
    """Held-out reward of whatever is live right now; each materialisation is one point in time."""
    svc = services(settings, store, mlflow)
    res = rounds.evaluate_live(svc)
    run_id = svc.lineage.round_run("live-monitoring")
    svc.lineage.log_metrics(run_id, {"live_heldout_reward": res["heldout_reward"]}, int(time.time()))
    svc.lineage.set_tags(run_id, {"live_policy_version": res["policy_version"], "engine": res["engine"]})
    return MaterializeResult(metadata={**res, "mlflow_run_id": run_id})


live_eval_job = define_asset_job("live_eval", selection=[live_heldout_eval],
                                 description="Evaluate the live deployment on the held-out set.")
live_eval_schedule = ScheduleDefinition(job=live_eval_job, cron_schedule="0 */6 * * *",
                                        description="Held-out reward of the live deployment every 6 hours.")
