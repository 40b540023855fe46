"""Re-scoring as a Dagster job: `prodrl rewards rescore` from the launchpad."""

from dagster import Config, MetadataValue, OpExecutionContext, Output, job, op

from prodrl_pipelines.ops.ray_scoring import rescore_step
from prodrl_pipelines.resources.settings import ProdRLSettings, StoreResource


class RescoreConfig(Config):
    source: str
    versions: list[str] = []  # default: every older version of the source


@op(description="Re-score stored trajectories with a source's current version; old reward rows are kept. "
                 "On a Ray cluster with scoring workers: a Ray Data job.")
def rescore_op(context: OpExecutionContext, config: RescoreConfig, settings: ProdRLSettings, store: StoreResource):
    rep = rescore_step(context, settings, store, config.source, config.versions or None)
    context.log.info(rep.summary())
    return Output(rep.summary(), metadata={
        "source": rep.source, "version": rep.version, "from_versions": MetadataValue.json(rep.from_versions),
        "trajectories": rep.trajectories, "scored": rep.scored, "changed": rep.changed,
        "mean_abs_change": rep.mean_abs_change, "max_abs_change": rep.max_abs_change,
        "old_mean": rep.old_mean, "new_mean": rep.new_mean, "pending": rep.pending, "failed": rep.failed,
        "first_error": rep.first_error or "none", "already_trained": rep.already_trained})


@job(description="Re-score stored trajectories with a reward source's current version (grader fixed, new rubric).")
def rescore_rewards_job():
    rescore_op()
