"""Data-volume sensor: starts round k+1 when round k finished and S*B eligible trajectories exist."""



from dagster import (
    DagsterRunStatus, DefaultSensorStatus, RunRequest, RunsFilter, SensorEvaluationContext, SensorResult,
    SkipReason, define_asset_job, sensor, AssetSelection,
)

from prodrl_pipelines import environment, rounds
from prodrl_pipelines.assets.partitions import ROUND_TAG, rounds_partitions
from prodrl_pipelines.resources.settings import ProdRLSettings, StoreResource, services

round_job = define_asset_job(
    "prod_rl_round",
    selection=AssetSelection.groups("prod_rl_round"),
    partitions_def=rounds_partitions,
    tags={ROUND_TAG: "train"},
    description="One prod-RL round: select -> batch -> train -> export -> evaluate -> gate -> deploy.",
)

IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


@sensor(job=round_job, minimum_interval_seconds=environment.sensor_interval_s(),
        default_status=DefaultSensorStatus.RUNNING)
def data_volume_sensor(context: SensorEvaluationContext, settings: ProdRLSettings, store: StoreResource):
    """Adds the next `rounds` partition and requests its run in one tick (run_key = partition key)."""
    existing = context.instance.get_dynamic_partitions(rounds_partitions.name)
    in_flight = bool(context.instance.get_run_records(
        RunsFilter(job_name=round_job.name, statuses=IN_FLIGHT), limit=1))
    key, reason = rounds.next_round_decision(services(settings, store), existing, in_flight)
    if key is None:
        return SkipReason(reason)
    context.log.info(f"starting {key}: {reason}")
    return SensorResult(
        run_requests=[RunRequest(partition_key=key, run_key=key, tags={ROUND_TAG: "train"})],
        dynamic_partitions_requests=[rounds_partitions.build_add_request([key])],
    )
