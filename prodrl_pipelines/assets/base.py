"""Round 0: the base policy from the model source (``base_model``), evaluated, deployed, registered."""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset, define_asset_job

from prodrl_pipelines.loop import bootstrap
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, open_services


@asset(group_name="base", kinds={"pytorch"})
def base_policy(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                mlflow: MlflowResource) -> MaterializeResult:
    """round-000000: the base model (a Hugging Face directory, an s3:// URI, or a registered source such
    as the lab's toy model) imported and checked, exported with `export_scheme`, evaluated on the
    held-out suite, deployed and registered as `champion`."""
    svc = open_services(settings, store, mlflow)
    stats = bootstrap.bootstrap(svc)
    return MaterializeResult(metadata={
        "base_model": stats["base_model"], "heldout_reward": stats["heldout_reward"],
        "heldout_ci95": stats["heldout_ci95"], "reward_errors": stats["reward_errors"],
        "suite": svc.suite.name, "checkpoint_dir": MetadataValue.path(stats["checkpoint_dir"]),
        "model_version": stats["model_version"], "mlflow_run": MetadataValue.url(svc.lineage.run_url(stats["mlflow_run_id"])),
        **{k: stats[k] for k in ("source", "parameters") if k in stats},
    })


bootstrap_job = define_asset_job("bootstrap", selection=[base_policy],
                                 description="Import, evaluate and deploy the round-0 policy (base_model).")
