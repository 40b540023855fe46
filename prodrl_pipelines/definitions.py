"""The one Definitions object of the prodrl_pipelines code location."""

from dagster import Definitions, define_asset_job

from prodrl_pipelines.assets.gate import deployment_gate
from prodrl_pipelines.assets.lab import base_policy, lab_traffic_job
from prodrl_pipelines.assets.monitoring import live_eval_job, live_eval_schedule, live_heldout_eval
from prodrl_pipelines.assets.round import (
    deployment, exported_policy, heldout_eval, recorded_trajectories, trained_checkpoint, training_batch,
)
from prodrl_pipelines.resources.settings import default_resources
from prodrl_pipelines.sensors import data_volume_sensor, round_job

bootstrap_job = define_asset_job("bootstrap_lab", selection=[base_policy],
                                 description="Build, evaluate and deploy the round-0 lab policy.")



def build_definitions(resources: dict | None = None) -> Definitions:
    """The code location; ``resources`` default to the environment (see `default_resources`)."""
    return Definitions(
        assets=[base_policy, recorded_trajectories, training_batch, trained_checkpoint, exported_policy,
                heldout_eval, deployment, live_heldout_eval],
        asset_checks=[deployment_gate],
        jobs=[round_job, bootstrap_job, lab_traffic_job, live_eval_job],
        sensors=[data_volume_sensor],
        schedules=[live_eval_schedule],
        resources=resources if resources is not None else default_resources(),
    )


defs = build_definitions()
