"""Compaction and vacuum of the trajectory store's tables: hourly, and on demand from the UI."""

from dagster import AssetExecutionContext, Config, MaterializeResult, MetadataValue, ScheduleDefinition, asset, define_asset_job

from prodrl_pipelines.loop import data
from prodrl_pipelines.resources.settings import ProdRLSettings, StoreResource, open_services
from prodrl_pipelines.trajectories import maintenance


class MaintenanceConfig(Config):
    retention_hours: float = 168.0  # files unreferenced for less than this stay (time travel, slow readers)
    vacuum: bool = True


@asset(group_name="maintenance")
def store_compaction(context: AssetExecutionContext, config: MaintenanceConfig, settings: ProdRLSettings,
                     store: StoreResource):
    """Small files of every table compacted, then a vacuum that keeps what rounds in flight pinned."""
    svc = open_services(settings, store)
    compacted = maintenance.compact(svc.store)
    vacuumed = maintenance.vacuum(svc.store, config.retention_hours, data.in_flight_pins(svc)) if config.vacuum else {}
    context.log.info(f"compacted {compacted}; vacuumed {vacuumed}")
    return MaterializeResult(metadata={
        "compacted": MetadataValue.json(compacted), "vacuumed": MetadataValue.json(vacuumed),
        "files_after": sum(t["files_after"] for t in compacted.values()),
    })


store_maintenance_job = define_asset_job("store_maintenance", selection=[store_compaction],
                                         description="Compact and vacuum the trajectory store's tables.")
store_maintenance_schedule = ScheduleDefinition(job=store_maintenance_job, cron_schedule="17 * * * *",
                                                description="Compact and vacuum the trajectory store every hour.")
