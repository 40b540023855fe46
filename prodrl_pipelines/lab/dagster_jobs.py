"""The lab's Dagster job: simulated traffic against the live deployment (entry point group
``prodrl_pipelines.definitions``, merged into the code location's Definitions)."""

from dagster import Config, Definitions, OpExecutionContext, job, op

from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import ProdRLSettings, StoreResource, open_services


class TrafficConfig(Config):
    episodes: int = 256


@op
def serve_lab_traffic(context: OpExecutionContext, config: TrafficConfig, settings: ProdRLSettings,
                      store: StoreResource) -> None:
    """Send lab tasks through the live deployment and record calls and rewards."""
    stats = simulate_traffic(open_services(settings, store), config.episodes)
    context.log.info(f"recorded {stats['episodes']} episodes from {stats['policy_version']}, reward {stats['reward_mean']:.3f}")


@job(description="Simulated production traffic against the live deployment (lab only).")
def lab_traffic_job():
    serve_lab_traffic()


def lab_definitions() -> Definitions:
    return Definitions(jobs=[lab_traffic_job])
