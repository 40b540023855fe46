"""Erasure with its lineage: the store's rows erased (``trajectories.erasure``), then every MLflow
model version of a round that trained on them tagged ``prodrl.trained_on_erased_data`` with the
erasure's id (its other tags, its lineage and the round's ledger stay as decided)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from prodrl_pipelines.loop.lineage import ROUND_TAG
from prodrl_pipelines.loop.services import Services
from prodrl_pipelines.trajectories import erasure

ERASED_TAG = "prodrl.trained_on_erased_data"


def erase(svc: Services, req: erasure.Erasure, dry_run: bool = False) -> dict:
    report = erasure.erase(svc.store, req, dry_run=dry_run)
    marked = []
    if report["rounds_trained"] and not dry_run and svc.lineage is not None:
        rounds = set(report["rounds_trained"])
        for mv in svc.lineage.versions():
            tags = dict(mv.tags or {})
            if tags.get(ROUND_TAG) in rounds:
                before = [x for x in tags.get(ERASED_TAG, "").split(",") if x]
                svc.lineage.tag_version(mv.version, {ERASED_TAG: ",".join([*before, report["erasure_id"]])})
                marked.append(str(mv.version))
    report["model_versions_marked"] = marked
    return report


def apply_retention(svc: Services, now: datetime | None = None) -> dict | None:
    """Erase what ``data.retention_days`` no longer keeps (None when it keeps everything)."""
    days = svc.settings.data.retention_days
    if not days:
        return None
    now = now or datetime.now(timezone.utc)
    return erase(svc, erasure.Erasure(before=now - timedelta(days=days), requested_by="retention",
                                      reason=f"data.retention_days = {days:g}"))
