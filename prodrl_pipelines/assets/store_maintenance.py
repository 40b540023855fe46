"""Retention, compaction and vacuum of the trajectory store's tables: hourly, and on demand from the UI."""

from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, ScheduleDefinition, asset, define_asset_job

from prodrl_pipelines.loop import data, data_erasure
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, open_services
from prodrl_pipelines.trajectories import maintenance


class MaintenanceConfig(Config):
    retention_hours: float = 168.0  # files unreferenced for less than this stay (time travel, slow readers)
    vacuum: bool = True


@asset(group_name="maintenance")
def store_compaction(context: AssetExecutionContext, config: MaintenanceConfig, settings: ProdRLSettings,
                     store: StoreResource, mlflow: MlflowResource):
    """What ``data.retention_days`` no longer keeps erased (audited), small files of every table
    compacted, then a vacuum that keeps what rounds in flight pinned."""
    svc = open_services(settings, store, mlflow)  # retention tags the rounds that trained on what it erased
    retention = data_erasure.apply_retention(svc)
    if retention is not None:
        context.log.info(f"retention: {retention}")
    compacted = maintenance.compact(svc.store)
    vacuumed = maintenance.vacuum(svc.store, config.retention_hours, data.in_flight_pins(svc)) if config.vacuum else {}
    context.log.info(f"compacted {compacted}; vacuumed {vacuumed}")
    return MaterializeResult(metadata={
        "retention": MetadataValue.json(retention or {"retention_days": 0}),
        "compacted": MetadataValue.json(compacted), "vacuumed": MetadataValue.json(vacuumed),
        "files_after": sum(t["files_after"] for t in compacted.values()),
    })


store_maintenance_job = define_asset_job("store_maintenance", selection=[store_compaction],
                                         description="Compact and vacuum the trajectory store's tables.")
store_maintenance_schedule = ScheduleDefinition(job=store_maintenance_job, cron_schedule="17 * * * *",
                                                description="Compact and vacuum the trajectory store every hour.")
