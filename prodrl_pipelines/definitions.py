"""The one Definitions object of the prodrl_pipelines code location.

Packages add jobs, assets or sensors through the entry point group ``prodrl_pipelines.definitions``
(a function returning ``Definitions``, merged here); the lab adds its traffic job that way.
"""

from importlib.metadata import entry_points

from dagster import Definitions, in_process_executor

from prodrl_pipelines.assets.base import base_policy, bootstrap_job
from prodrl_pipelines.assets.gate import deployment_gate
from prodrl_pipelines.assets.monitor_checks import behaviour_monitors
from prodrl_pipelines.assets.monitoring import live_eval_job, live_eval_schedule, live_heldout_eval
from prodrl_pipelines.assets.store_maintenance import (
    store_compaction, store_maintenance_job, store_maintenance_schedule,
)
from prodrl_pipelines.assets.round import (
    deployment, exported_policy, heldout_eval, recorded_trajectories, scored_rewards, trained_checkpoint,
    training_batch,
)
from prodrl_pipelines.ops.canary_scoring import canary_scoring_job
from prodrl_pipelines.ops.rescore import rescore_rewards_job
from prodrl_pipelines.resources.settings import default_resources
from prodrl_pipelines.sensors import canary_sensor, data_volume_sensor, registry_decision_job, registry_sensor, round_job

DEFINITIONS_GROUP = "prodrl_pipelines.definitions"


def build_definitions(resources: dict | None = None) -> Definitions:
    """The code location; ``resources`` default to the environment (see `default_resources`)."""
    core = Definitions(
        assets=[base_policy, scored_rewards, recorded_trajectories, training_batch, trained_checkpoint, exported_policy,
                heldout_eval, deployment, live_heldout_eval, store_compaction],
        asset_checks=[deployment_gate, behaviour_monitors],
        jobs=[round_job, registry_decision_job, bootstrap_job, live_eval_job, store_maintenance_job,
              rescore_rewards_job, canary_scoring_job],
        sensors=[data_volume_sensor, registry_sensor, canary_sensor],
        schedules=[live_eval_schedule, store_maintenance_schedule],
        resources=resources if resources is not None else default_resources(),
        # every job's steps in its run's own process, as the round's (sensors.py): Dagster's default, a
        # process per step, adds a Python start-up and the code location's imports (torch,
        # transformers: ~3 CPU-s) to each run of a one-step job (bootstrap, canary scoring, live eval)
        executor=in_process_executor,
    )
    plugins = [ep.load()() for ep in entry_points(group=DEFINITIONS_GROUP)]
    return Definitions.merge(core, *plugins) if plugins else core


defs = build_definitions()
