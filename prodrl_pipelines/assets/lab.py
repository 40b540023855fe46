"""The laboratory: the round-0 base policy and simulated traffic (stand-ins for a real deployment)."""


from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, OpExecutionContext, asset, job, op

from prodrl_pipelines import rounds
from prodrl_pipelines.deployment import BASE_VERSION
from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, services


@asset(group_name="lab", kinds={"pytorch"})
def base_policy(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                mlflow: MlflowResource) -> MaterializeResult:
    """Round-0 policy: tiny Qwen3 lab model with a locally trained tokenizer, warm-started by SFT,
    exported, evaluated on the held-out set, deployed and registered as `champion`."""
    svc = services(settings, store, mlflow)
    stats = rounds.bootstrap_base_policy(svc)
    from pathlib import Path

    run_id = svc.lineage.round_run(BASE_VERSION, params=svc.settings.lab.model_dump())
    source = rounds.publish_export(svc, BASE_VERSION, Path(stats["export"]["export_dir"]))
    version = svc.lineage.register_candidate(source, run_id, BASE_VERSION,
                                             {"format": "bf16", "gate": "base", "heldout_reward": f"{stats['heldout_reward']:.4f}"})
    svc.lineage.log_metrics(run_id, {"heldout_reward": stats["heldout_reward"]}, 0)
    svc.lineage.promote(version)
    svc.lineage.finish(run_id)
    live = svc.registry.live()
    live.model_version = version
    svc.registry.deploy(live)
    svc.registry.update_round(BASE_VERSION, model_version=version, mlflow_run_id=run_id)
    return MaterializeResult(metadata={"heldout_reward": stats["heldout_reward"], "heldout_ci95": stats["heldout_ci95"],
                                       "checkpoint_dir": MetadataValue.path(stats["checkpoint_dir"]),
                                       "model_version": version})


class TrafficConfig(Config):
    episodes: int = 256


@op
def serve_lab_traffic(context: OpExecutionContext, config: TrafficConfig, settings: ProdRLSettings,
                      store: StoreResource) -> None:
    """Send lab tasks through the live deployment and record calls and rewards."""
    stats = simulate_traffic(services(settings, store), config.episodes)
    context.log.info(f"recorded {stats['episodes']} episodes from {stats['policy_version']}, reward {stats['reward_mean']:.3f}")


@job(description="Simulated production traffic against the live deployment (lab only).")
def lab_traffic_job():
    serve_lab_traffic()
