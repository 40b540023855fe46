"""Checkpoint and export directories in a store: a local directory or an object store (S3).

A published checkpoint is a directory of files plus a manifest (every file's relative path, size
and sha256). The manifest is written last and readers go through it, so a checkpoint is either
fully visible or absent, never half there:

* ``LocalCheckpointStore(root)``: ``<root>/<name>/`` is the directory itself with the manifest
  ``checkpoint_manifest.json`` inside it. Publishing a directory that already sits at
  ``<root>/<name>`` (what ``save_checkpoint`` writes) only adds the manifest; any other directory is
  copied to a temporary sibling, given its manifest and renamed into place.
* ``S3CheckpointStore(blobs, prefix)``: the files are uploaded under a fresh upload prefix
  ``<prefix>/<name>/files-<upload id>/...`` and then the manifest ``<prefix>/<name>/checkpoint_manifest.json``
  is written in one PUT, pointing at that upload. Until then readers see the previous manifest (or
  none); uploads the manifest does not point at are invisible and are deleted after a successful
  publish. One writer per name at a time.

``fetch(name, cache_dir)`` returns a local directory a Hugging Face loader can open: the store's own
directory for the local store, a verified download (sizes and sha256 against the manifest) under
``cache_dir/<name>`` for S3, reused while the manifest is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from datetime import datetime, timezone
from pathlib import Path

from prodrl_pipelines.storage.atomic import write_json_atomic
from prodrl_pipelines.storage.blobstore import BlobNotFoundError, BlobStore, validate_key

MANIFEST_NAME = "checkpoint_manifest.json"
MANIFEST_FORMAT = 1
_FILES_PREFIX = "files-"


class CheckpointNotFoundError(FileNotFoundError):
    """No published checkpoint under this name (never published, or its publish did not finish)."""


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint's files do not match its manifest; the message names the file."""


# ---------------------------------------------------------------------------------- manifests


def validate_name(name: str) -> str:
    """A checkpoint name is one key segment (``round-000007``, ``base``): no ``/``."""
    if not isinstance(name, str) or "/" in name:
        raise ValueError(f"checkpoint name must be a single path segment without '/', got {name!r}")
    return validate_key(name)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _local_files(local_dir: Path) -> list[Path]:
    """Regular files under ``local_dir`` (recursively, symlinks followed), minus any manifest."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {local_dir} does not exist")
    files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    if not files:
        raise ValueError(f"checkpoint directory {local_dir} holds no files")
    for p in files:
        validate_key(p.relative_to(local_dir).as_posix())  # the same relative paths must work as keys
    return files


def build_manifest(local_dir: Path, name: str, **extra) -> dict:
    """The manifest of ``local_dir``: relative posix path, size and sha256 of every file."""
    local_dir = Path(local_dir)
    entries = [{"path": p.relative_to(local_dir).as_posix(), "size": p.stat().st_size, "sha256": file_sha256(p)}
               for p in _local_files(local_dir)]
    return {"format": MANIFEST_FORMAT, "name": name, "files": entries,
            "total_bytes": sum(e["size"] for e in entries),
            "created_at": datetime.now(timezone.utc).isoformat(), **extra}


def verify_directory(local_dir: Path, manifest: dict, *, sha256: bool = True) -> None:
    """Raise ``CheckpointIntegrityError`` unless every manifest file is present with its size (and hash)."""
    local_dir = Path(local_dir)
    for e in manifest["files"]:
        p = local_dir / e["path"]
        if not p.is_file():
            raise CheckpointIntegrityError(f"{p} is missing (checkpoint {manifest.get('name')!r})")
        size = p.stat().st_size
        if size != e["size"]:
            raise CheckpointIntegrityError(f"{p} has {size} bytes, the manifest says {e['size']}")
        if sha256:
            digest = file_sha256(p)
            if digest != e["sha256"]:
                raise CheckpointIntegrityError(f"{p} has sha256 {digest}, the manifest says {e['sha256']}")


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` directory to ``final``, replacing a previous one as a whole."""
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


# ---------------------------------------------------------------------------------- stores


class CheckpointStore(ABC):
    """Named checkpoint directories (``round-000007``...), published atomically, read through a manifest."""

    @abstractmethod
    def publish(self, local_dir: Path | str, name: str) -> str:
        """Make ``local_dir`` the checkpoint ``name`` (replacing a previous one as a whole); return its URI."""

    @abstractmethod
    def fetch(self, name: str, cache_dir: Path | str | None = None) -> Path:
        """A verified local directory holding checkpoint ``name``; ``CheckpointNotFoundError`` if unpublished."""

    @abstractmethod
    def manifest(self, name: str) -> dict:
        """The published manifest of ``name``; ``CheckpointNotFoundError`` if unpublished."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """True when ``name`` is published (its manifest is visible)."""

    @abstractmethod
    def uri(self, name: str) -> str:
        """URI of the published directory (``file://...`` or ``s3://...``), e.g. an MLflow model version source."""

    @abstractmethod
    def names(self) -> list[str]:
        """Published checkpoint names, sorted."""


class LocalCheckpointStore(CheckpointStore):
    """Checkpoints as directories ``<root>/<name>/`` with the manifest inside."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"LocalCheckpointStore({str(self.root)!r})"

    def path(self, name: str) -> Path:
        return self.root / validate_name(name)

    def publish(self, local_dir: Path | str, name: str) -> str:
        final = self.path(name)
        src = Path(local_dir).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        if src == final:  # already in place (save_checkpoint wrote it): the manifest completes it
            write_json_atomic(final / MANIFEST_NAME, build_manifest(final, name))
            return final.as_uri()
        tmp = self.root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(MANIFEST_NAME))
            write_json_atomic(tmp / MANIFEST_NAME, build_manifest(tmp, name))
            _swap_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final.as_uri()

    def manifest(self, name: str) -> dict:
        f = self.path(name) / MANIFEST_NAME
        try:
            return json.loads(f.read_text())
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no published checkpoint {name!r} in {self.root} ({f} is missing)") from None

    def fetch(self, name: str, cache_dir: Path | str | None = None, *, sha256: bool = False) -> Path:
        """The store's own directory (``cache_dir`` is not needed), after checking sizes (and hashes if asked)."""
        m = self.manifest(name)
        verify_directory(self.path(name), m, sha256=sha256)
        return self.path(name)

    def exists(self, name: str) -> bool:
        return (self.path(name) / MANIFEST_NAME).is_file()

    def uri(self, name: str) -> str:
        self.manifest(name)
        return self.path(name).as_uri()

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith(".") and (p / MANIFEST_NAME).is_file())


class S3CheckpointStore(CheckpointStore):
    """Checkpoints in a ``BlobStore`` (``S3BlobStore`` in production) under ``<prefix>/<name>/``.

    Large files use the blob store's ``put_file``/``get_file`` when it has them (S3: multipart and
    ranged downloads without holding a file in memory), else ``put_bytes``/``get_bytes``.
    """

    def __init__(self, blobs: BlobStore, prefix: str = "checkpoints") -> None:
        self.blobs = blobs
        self.prefix = validate_key(prefix.strip("/"))

    def __repr__(self) -> str:
        return f"S3CheckpointStore({self.blobs!r}, {self.prefix!r})"

    def _manifest_key(self, name: str) -> str:
        return f"{self.prefix}/{validate_name(name)}/{MANIFEST_NAME}"

    def _files_prefix(self, name: str, upload_id: str) -> str:
        return f"{self.prefix}/{validate_name(name)}/{_FILES_PREFIX}{upload_id}"

    # --------------------------------------------------------------------------- publish

    def _put_file(self, key: str, path: Path) -> None:
        put_file = getattr(self.blobs, "put_file", None)
        if put_file is not None:
            put_file(key, path)
        else:
            self.blobs.put_bytes(key, path.read_bytes())

    def publish(self, local_dir: Path | str, name: str) -> str:
        local_dir = Path(local_dir)
        validate_name(name)
        upload_id = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}"
        files_prefix = self._files_prefix(name, upload_id)
        manifest = build_manifest(local_dir, name, upload_id=upload_id, files_prefix=files_prefix)
        uploaded: list[str] = []
        try:
            for e in manifest["files"]:
                key = f"{files_prefix}/{e['path']}"
                self._put_file(key, local_dir / e["path"])
                uploaded.append(key)
            # The commit point: one atomic PUT makes the new upload the checkpoint.
            self.blobs.put_bytes(self._manifest_key(name), json.dumps(manifest, indent=1, sort_keys=True).encode())
        except BaseException:
            for key in uploaded:  # best effort: an unreferenced upload is invisible anyway
                try:
                    self.blobs.delete(key, missing_ok=True)
                except Exception:  # noqa: BLE001
                    pass
            raise
        self._delete_stale_uploads(name, keep=upload_id)
        return self.blobs.uri(files_prefix)

    def _delete_stale_uploads(self, name: str, keep: str) -> None:
        """Delete the files of uploads the manifest no longer points at (the superseded version and
        leftovers of failed publishes). Best effort: a failure here leaves garbage, not damage."""
        keep_prefix = self._files_prefix(name, keep) + "/"
        try:
            for key in self.blobs.list(f"{self.prefix}/{name}/{_FILES_PREFIX}"):
                if not key.startswith(keep_prefix):
                    self.blobs.delete(key, missing_ok=True)
        except Exception:  # noqa: BLE001
            pass

    # --------------------------------------------------------------------------- read

    def _read_manifest(self, name: str) -> dict | None:
        try:
            return json.loads(self.blobs.get_bytes(self._manifest_key(name)))
        except BlobNotFoundError:
            return None

    def manifest(self, name: str) -> dict:
        m = self._read_manifest(name)
        if m is None:
            raise CheckpointNotFoundError(
                f"no published checkpoint {name!r} at {self.blobs.uri(self._manifest_key(name))} "
                "(never published, or its publish did not finish)")
        return m

    def exists(self, name: str) -> bool:
        return self.blobs.exists(self._manifest_key(name))

    def uri(self, name: str) -> str:
        return self.blobs.uri(self.manifest(name)["files_prefix"])

    def names(self) -> list[str]:
        suffix = "/" + MANIFEST_NAME
        out = []
        for key in self.blobs.list(self.prefix + "/"):
            rest = key[len(self.prefix) + 1:]
            if rest.endswith(suffix) and "/" not in rest[: -len(suffix)]:
                out.append(rest[: -len(suffix)])
        return sorted(out)

    def _get_file(self, key: str, path: Path) -> None:
        get_file = getattr(self.blobs, "get_file", None)
        if get_file is not None:
            get_file(key, path)
        else:
            path.write_bytes(self.blobs.get_bytes(key))

    def fetch(self, name: str, cache_dir: Path | str | None = None) -> Path:
        """Download ``name`` into ``cache_dir/<name>`` (verified against the manifest), or reuse it.

        A cached copy is reused when its manifest equals the published one and its file sizes match;
        downloads go to a temporary sibling that replaces the cached copy only once fully verified.
        """
        if cache_dir is None:
            raise ValueError("S3CheckpointStore.fetch needs a cache_dir to download into")
        cache_dir = Path(cache_dir)
        final = cache_dir / validate_name(name)
        for attempt in range(2):
            m = self.manifest(name)
            cached = final / MANIFEST_NAME
            if cached.is_file():
                try:
                    if json.loads(cached.read_text()) == m:
                        verify_directory(final, m, sha256=False)
                        return final
                except (ValueError, CheckpointIntegrityError):
                    pass  # stale or damaged copy: download again
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = cache_dir / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                for e in m["files"]:
                    dest = tmp / e["path"]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    self._get_file(f"{m['files_prefix']}/{e['path']}", dest)
                verify_directory(tmp, m, sha256=True)
                write_json_atomic(tmp / MANIFEST_NAME, m)
                _swap_into_place(tmp, final)
                return final
            except BlobNotFoundError as err:
                shutil.rmtree(tmp, ignore_errors=True)
                # Republished while we read: the old upload was deleted. Read the new manifest once more.
                if attempt == 0 and self._read_manifest(name) != m:
                    continue
                raise CheckpointIntegrityError(
                    f"checkpoint {name!r}: {err} although its manifest lists it") from err
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        raise AssertionError("unreachable")
