"""An export on a Ray node that may not see the deploying process's disk.

``export_source(settings, export_dir)`` (deploying process) describes where the export lives in the
exports store: a JSON-able dict for S3, None for local files. ``locate(export_dir, source)`` (node)
returns ``export_dir`` when it holds the export, else a verified copy fetched from the store into the
node's cache (``PRODRL_NODE_CACHE``, default ``~/.cache/prodrl/node-exports``). Credentials never
travel in the source: the node's boto3 default chain (environment, profile, role) supplies them.
A fetch killed half-way leaves a temporary directory that the next fetch of that name removes; after
each fetch the cache keeps the ``KEEP`` most recent exports of that store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import socket
from pathlib import Path
from typing import Any

from prodrl_pipelines.deploy_targets.base import DeployError
from prodrl_pipelines.storage.checkpoints import (MANIFEST_NAME, CheckpointIntegrityError, CheckpointNotFoundError,
                                                  S3CheckpointStore, verify_directory)
from prodrl_pipelines.storage.locations import StoreLocation
from prodrl_pipelines.storage.s3 import S3BlobStoreError

KIND = "exports"
KEEP = 3  # exports a node keeps per store: the live one, the one before it (rollback), one more


def export_source(settings: Any, export_dir: str | Path, store: StoreLocation | None = None) -> dict | None:
    """Where export ``export_dir`` (published under its directory's name) lives on S3; None for a local store.

    ``store``: the deployment's store (default: the ``PRODRL_S3_*`` / ``PRODRL_STORE_ROOT`` environment).
    Makes no request: whether the export is published is the node's question (``locate`` says so).
    """
    if store is None:
        from prodrl_pipelines.config import environment

        store = StoreLocation(**environment.read_store())
    if not store.on_s3:
        return None
    cs = store.checkpoint_store(settings, KIND)
    name = Path(export_dir).name
    return {"store": "s3", "bucket": store.s3_bucket, "prefix": store.s3_prefix, "kind": KIND, "name": name,
            "endpoint_url": store.s3_endpoint_url, "region": store.s3_region,
            "uri": cs.blobs.uri(f"{cs.prefix}/{name}")}


def _store(source: dict) -> S3CheckpointStore:
    loc = StoreLocation(s3_bucket=source["bucket"], s3_prefix=source.get("prefix", ""),
                        s3_endpoint_url=source.get("endpoint_url", ""), s3_region=source.get("region", ""))
    return loc.checkpoint_store(None, source.get("kind", KIND))  # settings only place local stores


def _holds(path: Path, manifest: dict) -> bool:
    try:
        verify_directory(path, manifest, sha256=False)  # sizes: the deploying disk's copy, seen through a mount
        return True
    except CheckpointIntegrityError:
        return False


def cache_dir(source: dict, cache_root: str | Path | None = None) -> Path:
    """The directory the export's copy goes in: one per store, so two deployments' ``round-000007`` never mix."""
    from prodrl_pipelines.config import environment

    root = cache_root or environment.node_cache()
    where = json.dumps([source.get(k, "") for k in ("endpoint_url", "bucket", "prefix", "kind")])
    return Path(root).expanduser() / hashlib.sha256(where.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive ``flock``: replicas on one node (processes or threads) fetch one name one at a time,
    since the store's fetch replaces a cached copy in place, under whoever is reading it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prune(cache: Path, keep: int, current: str) -> list[str]:
    """Delete all but the ``keep`` most recently fetched exports of one store's cache (``current``
    always stays; one being fetched or read under its lock is skipped). The names deleted. A server
    still running from a deleted copy keeps its open files; started again, it fetches the copy again."""
    copies = sorted((p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != current),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    gone = []
    for old in copies[max(0, keep - 1):]:
        lock = cache / f".{old.name}.lock"
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # fetched or verified right now by another replica
            try:
                shutil.rmtree(old, ignore_errors=True)
                gone.append(old.name)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    return gone


def locate(export_dir: str, source: dict | None, cache_root: str | None = None) -> str:
    """``export_dir`` when it holds the export, else a verified copy from ``source``'s store (see module doc).

    A cached copy is reused after a full sha256 check against the published manifest (the server reads
    every file at start anyway); a damaged one is deleted and downloaded again. A download that does not
    match the manifest raises ``DeployError`` naming the file and leaves nothing behind.
    """
    path = Path(export_dir)
    if (path / "config.json").is_file():  # the deploying disk, shared (a mount, the local cluster): used as is,
        own = path / MANIFEST_NAME  # whether or not the store has it yet (a bootstrap deploys before publishing)
        if not own.is_file() or _holds(path, json.loads(own.read_text())):
            return export_dir
    if source is None:
        raise DeployError(
            f"export {export_dir} is missing or incomplete on node {socket.gethostname()} and no store source "
            "was given: "
            "put the deployment's store on S3 (PRODRL_S3_BUCKET ...; the node needs the credentials in its "
            "boto3 chain) so the node fetches the export, or mount the exports directory at the same path")
    name, store = source["name"], _store(source)
    uri = source.get("uri") or store.blobs.uri(f"{store.prefix}/{name}")
    try:
        manifest = store.manifest(name)
    except (CheckpointNotFoundError, S3BlobStoreError) as e:
        raise DeployError(f"export {export_dir} is not on node {socket.gethostname()} and its manifest at {uri} "
                          f"cannot be read: {e}") from None
    cache = cache_dir(source, cache_root)
    final = cache / name
    with _locked(cache / f".{name}.lock"):
        for left in cache.glob(f".{name}.tmp-*"):  # a fetch killed half-way (none runs: the lock is ours)
            shutil.rmtree(left, ignore_errors=True)
        try:
            if (final / MANIFEST_NAME).is_file() and json.loads((final / MANIFEST_NAME).read_text()) == manifest:
                verify_directory(final, manifest, sha256=True)
                return str(final)
        except (ValueError, CheckpointIntegrityError):
            shutil.rmtree(final, ignore_errors=True)  # damaged on this disk (bit rot, a hand edit): fetch again
        try:
            got = str(store.fetch(name, cache))  # temp dir, verified, renamed into place
            prune(cache, keep=KEEP, current=name)
            return got
        except CheckpointIntegrityError as e:
            raise DeployError(f"export {name} fetched from {uri} on node {socket.gethostname()} does not match "
                              f"its manifest: {e}") from None
        except (CheckpointNotFoundError, S3BlobStoreError) as e:
            raise DeployError(f"export {name} could not be fetched from {uri} on node {socket.gethostname()}: "
                              f"{e}") from None
