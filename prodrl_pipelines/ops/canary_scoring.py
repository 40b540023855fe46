"""Scoring a running canary's window as a run of its own, requested by the canary sensor.

The sensor's tick only judges the rewards already recorded: scoring (a judge included) may be slow
or hang, and Dagster cuts a tick at 60 s, so it runs here, one run at a time per round, bounded by
``deploy.canary_scoring_budget_s`` and the judge's circuit breaker. Its report is kept beside the
round (``loop.canary.record_scoring``) and shown in the sensor's skip reason and in this run's metadata.
"""

from dagster import MetadataValue, OpExecutionContext, Output, job, op

from prodrl_pipelines.assets.partitions import rounds_partitions
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, open_services

CANARY_SCORING_JOB = "canary_scoring"
# not the round tag: its concurrency limit (one round at a time) would queue a promotion behind a scoring run
SCORING_TAG = "prodrl/canary_scoring"


@op(description="Score the running canary's window (both versions, complete trajectories) with the reward "
                 "plan's scorers, for at most deploy.canary_scoring_budget_s; what is left waits for the next run.")
def score_canary_window(context: OpExecutionContext, settings: ProdRLSettings, store: StoreResource,
                        mlflow: MlflowResource):
    from prodrl_pipelines.loop import canary

    rkey = context.partition_key
    svc = open_services(settings, store, mlflow)
    if canary.running_canary(svc) != rkey:
        return Output("no canary of this round is running", metadata={"round": rkey, "scored": 0})
    rep = canary.score_completed(svc, rkey, budget_s=svc.settings.deploy.canary_scoring_budget_s)
    doc = canary.record_scoring(svc, rkey, rep, context.run_id)
    scored = sum(r.get("scored", 0) for r in rep["sources"].values())
    left = canary.scoring_summary(doc)
    context.log.info(f"{rkey} canary window: {rep['trajectories']} trajectories, {scored} scored, "
                     f"{rep['in_flight']} in flight" + (f"; {left}" if left else ""))
    return Output(f"scored {scored}", metadata={
        "round": rkey, "trajectories": rep["trajectories"], "in_flight": rep["in_flight"], "scored": scored,
        "sources": MetadataValue.json(rep["sources"]), "left_unscored": left or "none"})


@job(name=CANARY_SCORING_JOB, partitions_def=rounds_partitions,
     description="The canary sensor's scoring of a running canary's window, out of the sensor's tick.")
def canary_scoring_job():
    score_canary_window()
