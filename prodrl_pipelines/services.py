"""What every round step works with: the settings, the stores, the lineage, and moving checkpoints
and exports between this machine and the object store."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from prodrl_pipelines.deployment import DeploymentRegistry, LiveDeployment, round_index
from prodrl_pipelines.settings import Settings
from prodrl_pipelines.tracking import Lineage


class RoundError(RuntimeError):
    """A round cannot proceed; the message says which input or setting is at fault."""


@dataclass
class Services:
    settings: Settings
    blobs: object
    lineage: Lineage | None = None
    exports_store: object | None = None  # CheckpointStore where deployable exports are published
    checkpoints_store: object | None = None  # CheckpointStore where trained checkpoints are published

    @property
    def registry(self) -> DeploymentRegistry:
        return DeploymentRegistry(self.blobs)

    @property
    def s3_endpoint_url(self) -> str | None:
        return getattr(self.blobs, "endpoint_url", None)

    @property
    def suite(self):
        """The held-out evaluation suite of the settings (``eval.suite``), loaded once."""
        if getattr(self, "_suite", None) is None:
            from prodrl_pipelines.evaluation import load_suite

            self._suite = load_suite(self.settings.eval.suite, self.settings.eval.reward_fn, self.settings,
                                     self.s3_endpoint_url)
        return self._suite

    @property
    def store(self):
        from prodrl_pipelines.trajectories.store import TrajectoryStore

        return TrajectoryStore(self.blobs)

    def live(self) -> LiveDeployment:
        live = self.registry.live()
        if live is None:
            raise RoundError(
                "no live deployment: bootstrap the round-0 policy first (asset `base_policy` or `prodrl bootstrap`)"
            )
        # On a fresh machine (another pod, a restarted worker) the live policy comes from the stores.
        ensure_local(self, "checkpoints", live.policy_version, Path(live.checkpoint_dir))
        ensure_local(self, "exports", live.policy_version, Path(live.export_dir))
        if not (Path(live.checkpoint_dir) / "config.json").exists():
            raise RoundError(f"live checkpoint {live.policy_version} is missing at {live.checkpoint_dir}"
                             + ("" if self.checkpoints_store is None else f" and in {self.checkpoints_store!r}"))
        return live


def ensure_local(svc: Services, kind: str, name: str, local_dir: Path | None = None) -> Path:
    """The local directory of checkpoint/export ``name`` (``kind`` "checkpoints" | "exports").

    Local directories are the store itself. With an object store, a directory that is missing here
    is fetched (verified against its manifest) into its usual place, so every step can run on a
    machine that did not produce it; a name never published is left missing for the caller to report.
    """
    from prodrl_pipelines.checkpoints import CheckpointNotFoundError

    s = svc.settings
    root = s.checkpoints_root if kind == "checkpoints" else s.exports_root
    local_dir = Path(local_dir) if local_dir is not None else root / name
    store = svc.checkpoints_store if kind == "checkpoints" else svc.exports_store
    if store is None or (local_dir / "config.json").exists():
        return local_dir
    try:
        got = store.fetch(name, local_dir.parent)
    except CheckpointNotFoundError:
        return local_dir
    if got != local_dir:  # fetched under its name; the registry recorded another directory name
        raise RoundError(f"{kind} {name} fetched to {got}, but the deployment expects it at {local_dir}")
    return got


def publish_checkpoint(svc: Services, name: str, checkpoint_dir: Path) -> str:
    """Publish a trained checkpoint to the checkpoints store (a no-op for local directories)."""
    if svc.checkpoints_store is None:
        return Path(checkpoint_dir).resolve().as_uri()
    return svc.checkpoints_store.publish(Path(checkpoint_dir), name)


def publish_export(svc: Services, name: str, export_dir: Path) -> str:
    """Publish an export to the exports store; returns the URI a model version registers as its
    source (``s3://...`` on S3, ``file://...`` locally; MLflow servers refuse local paths)."""
    if svc.exports_store is None:
        return Path(export_dir).resolve().as_uri()
    return svc.exports_store.publish(Path(export_dir), name)


def round_seed(settings: Settings, rkey: str) -> int:
    return settings.recipe.seed * 1_000_003 + round_index(rkey)


def _vocab_size(checkpoint_dir: str) -> int:
    return int(json.loads((Path(checkpoint_dir) / "config.json").read_text())["vocab_size"])


def _put_table(blobs, key: str, table: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    blobs.put_bytes(key, buf.getvalue())


def _get_table(blobs, key: str) -> pa.Table:
    if not blobs.exists(key):
        raise RoundError(f"{key} is missing: materialise the upstream asset of this round first")
    return pq.read_table(io.BytesIO(blobs.get_bytes(key)))


def _get_json(svc: Services, key: str):
    """A round document written by an upstream step (TrajectoryStore JSON), or a clear RoundError."""
    from prodrl_pipelines.trajectories.blobstore import BlobNotFoundError

    try:
        return svc.store.get_json(key)
    except BlobNotFoundError:
        raise RoundError(f"{key} is missing: materialise the upstream asset of this round first") from None


def preflight(svc: Services, live: LiveDeployment) -> None:
    """Settings that cannot work with this deployment fail before any data is touched."""
    r = svc.settings.recipe
    if r.needs_reference_model and not (Path(live.export_dir) / "prodrl_export.json").exists():
        raise RoundError(
            f"correction={r.correction!r} needs the deployed export of {live.policy_version} as the reference "
            f"model, but {live.export_dir} holds no export"
        )


def version_dirs(svc: Services, policy_version: str) -> tuple[Path, Path]:
    """(checkpoint dir, export dir) of a deployed policy version (the live one, or an earlier one)."""
    live = svc.registry.live()
    if live is not None and live.policy_version == policy_version:
        return Path(live.checkpoint_dir), Path(live.export_dir)
    if policy_version not in svc.registry.version_order():
        raise RoundError(f"policy version {policy_version!r} was never deployed "
                         f"(deployed: {svc.registry.version_order()})")
    return ensure_local(svc, "checkpoints", policy_version), ensure_local(svc, "exports", policy_version)
