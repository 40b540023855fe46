"""MLflow lineage: one run per round, a registered model version per candidate, and aliases.

`challenger` moves to every candidate; `champion` only to a deployed one (or, in review, to the
version a reviewer approves or rolls back to: ``review``). Checkpoints that already live in a store
are registered by URI (``create_model_version(source=...)``), never copied. Links point at the MLflow
UI: ``ui_url``, else the tracking server itself when it is one.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

# MLflow is imported where it is used: it costs ~1.3 s, paid by every process that loads the Dagster
# definitions (code servers, run workers) even when it never opens the lineage

ROUND_TAG = "prodrl.round"
CHALLENGER = "challenger"
CHAMPION = "champion"


def open_lineage(settings, tracking_uri: str = "", experiment: str = "prodrl", model_name: str = "prodrl-policy",
                 artifact_location: str = "", ui_url: str = "") -> Lineage:
    """The lineage of a home: ``tracking_uri`` (empty: SQLite under the settings home). A tracking
    server stores artifacts where it is configured to (e.g. S3); a local store keeps them under the
    home. Links open ``ui_url``, else $MLFLOW_UI_URL, else the tracking server, else the local UI."""
    from prodrl_pipelines.config import environment

    settings.home_path.mkdir(parents=True, exist_ok=True)
    uri = tracking_uri or settings.mlflow_uri
    default_artifacts = None if uri.startswith("http") else settings.mlflow_artifacts
    ui = ui_url or environment.mlflow_ui_url() or (uri if uri.startswith("http") else environment.LOCAL_MLFLOW_UI)
    return Lineage(uri, experiment, model_name, artifact_location=artifact_location or default_artifacts, ui_url=ui)


class Lineage:
    def __init__(self, tracking_uri: str, experiment: str = "prodrl", model_name: str = "prodrl-policy",
                 artifact_location: str | None = None, registry_uri: str | None = None, ui_url: str = ""):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)
        self.tracking_uri = tracking_uri
        self.ui_url = (ui_url or (tracking_uri if tracking_uri.startswith("http") else "")).rstrip("/")
        self.model_name = model_name
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_location)
            except MlflowException:  # created concurrently by another process
                self.experiment_id = self.client.get_experiment_by_name(experiment).experiment_id
        else:
            self.experiment_id = exp.experiment_id

    # --- runs -----------------------------------------------------------------------------
    def round_run(self, round_key: str, params: dict | None = None) -> str:
        """The run of this round (re-materialising a round reuses it)."""
        from mlflow.entities import Param

        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{ROUND_TAG}` = '{round_key}'", max_results=1
        )
        if found:
            return found[0].info.run_id
        run = self.client.create_run(self.experiment_id, run_name=round_key, tags={ROUND_TAG: round_key})
        if params:
            self.client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])
        return run.info.run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int, timestamp_ms: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])

    def metric_points(self, run_id: str, key: str) -> int:
        return len(self.client.get_metric_history(run_id, key))

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def log_bytes(self, run_id: str, data: bytes, filename: str, artifact_path: str | None = None) -> None:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / filename
            p.write_bytes(data)
            self.client.log_artifact(run_id, str(p), artifact_path)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI (``runs:/`` only when no UI is known)."""
        base = self.ui_url
        return f"{base}/#/experiments/{self.experiment_id}/runs/{run_id}" if base else f"runs:/{run_id}"

    def version_url(self, version: str) -> str:
        """The model version's page in the MLflow registry UI."""
        base = self.ui_url
        return f"{base}/#/models/{self.model_name}/versions/{version}" if base else f"models:/{self.model_name}/{version}"

    # --- registry ----------------------------------------------------------------------------
    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.model_name)
        except MlflowException:
            try:
                self.client.create_registered_model(self.model_name)
            except MlflowException:
                pass  # created concurrently

    def register_candidate(self, source_uri: str, run_id: str | None, round_key: str, tags: dict[str, str]) -> str:
        """Register (idempotently per round) the candidate and point `challenger` at it."""
        self._ensure_model()
        version = None
        for mv in self.client.search_model_versions(f"name = '{self.model_name}'"):
            if mv.tags.get(ROUND_TAG) == round_key and mv.source == source_uri:
                version = mv.version
                break
        if version is None:
            mv = self.client.create_model_version(
                self.model_name, source=source_uri, run_id=run_id, tags={ROUND_TAG: round_key, **tags}
            )
            version = mv.version
        else:
            self.tag_version(version, tags)
        self.client.set_registered_model_alias(self.model_name, CHALLENGER, version)
        return str(version)

    def tag_version(self, version: str, tags: dict[str, str]) -> None:
        """Set tags in the order given (callers order state tags so every prefix is consistent)."""
        for k, v in tags.items():
            self.client.set_model_version_tag(self.model_name, version, k, str(v))

    def describe_version(self, version: str, description: str) -> None:
        self.client.update_model_version(self.model_name, version, description=description)

    def versions(self) -> list:
        """Every registered version of the model (with its tags), oldest first."""
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.search_model_versions(f"name = '{self.model_name}'")
        except MlflowException:
            return []
        return sorted(found, key=lambda mv: int(mv.version))

    def version_tags(self, version: str) -> dict[str, str]:
        return dict(self.client.get_model_version(self.model_name, version).tags)

    def model_tags(self) -> dict[str, str]:
        from mlflow.exceptions import MlflowException

        try:
            return dict(self.client.get_registered_model(self.model_name).tags)
        except MlflowException:
            return {}

    def version(self, version: str):
        return self.client.get_model_version(self.model_name, str(version))

    def promote(self, version: str) -> None:
        self.client.set_registered_model_alias(self.model_name, CHAMPION, version)

    def alias_version(self, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(self.model_name, alias).version)
        except MlflowException:
            return None
