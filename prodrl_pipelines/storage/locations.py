"""``StoreLocation``: where one home's trajectories, documents, checkpoints and exports live.

Local directories by default (under the settings' home); with ``s3_bucket`` set, everything goes to
``s3://<s3_bucket>/<s3_prefix>/`` with the same key layout (checkpoints under ``checkpoints/``,
exports under ``exports/``). Credentials come from the boto3 default chain (env, profile, role).
Dagster's ``StoreResource``, the CLI and the stack all describe their stores with this one value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prodrl_pipelines.storage.blobstore import BlobStore, LocalBlobStore
from prodrl_pipelines.storage.checkpoints import CheckpointStore, LocalCheckpointStore, S3CheckpointStore

CHECKPOINT_KINDS = ("checkpoints", "exports")


@dataclass(frozen=True)
class StoreLocation:
    root: str = ""  # local: empty means <home>/store
    s3_bucket: str = ""  # empty: local directories
    s3_prefix: str = ""
    s3_endpoint_url: str = ""  # empty: AWS; else an S3-compatible server (MinIO, moto, ...)
    s3_region: str = ""  # empty: the boto3 default (AWS_REGION / profile), else us-east-1

    @property
    def on_s3(self) -> bool:
        return bool(self.s3_bucket)

    def blobs(self, settings: Any) -> BlobStore:
        """The blob store; ``settings`` (a ``config.settings.Settings``) places the local default."""
        if self.on_s3:
            from prodrl_pipelines.storage.s3 import S3BlobStore

            return S3BlobStore(self.s3_bucket, self.s3_prefix, endpoint_url=self.s3_endpoint_url or None,
                               region=self.s3_region or None)
        return LocalBlobStore(self.root or settings.store_root)

    def checkpoint_store(self, settings: Any, kind: str = "checkpoints") -> CheckpointStore:
        """``kind`` "checkpoints" (trained) or "exports" (deployable)."""
        if kind not in CHECKPOINT_KINDS:
            raise ValueError(f"kind must be one of {CHECKPOINT_KINDS}, got {kind!r}")
        if self.on_s3:
            return S3CheckpointStore(self.blobs(settings), kind)
        return LocalCheckpointStore(settings.checkpoints_root if kind == "checkpoints" else settings.exports_root)
