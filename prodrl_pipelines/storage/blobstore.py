"""A minimal object-store interface and its local-directory implementation.

Keys are ``/``-separated strings (``trajectories/policy_version=v1/part-....parquet``), never OS
paths, so the same layout works on a local directory and on S3. Writes are atomic: a reader sees
either the whole previous object, the whole new one, or nothing.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from pathlib import Path

from prodrl_pipelines.storage.atomic import write_bytes_atomic

_TMP_PREFIX = ".tmp-"
_BAD_SEGMENT = re.compile(r"^(\.|\.\.)$")


class BlobNotFoundError(KeyError):
    """No object under this key. A ``KeyError`` whose message names the key and the store root."""

    def __init__(self, key: str, root: str) -> None:
        super().__init__(key)
        self.key = key
        self.root = root

    def __str__(self) -> str:  # KeyError would repr() the key only
        return f"no object with key {self.key!r} in blob store {self.root}"


def validate_key(key: str) -> str:
    """Return ``key`` if it is a well-formed object key, else raise ``ValueError``.

    Well-formed: non-empty ``/``-separated segments, no leading or trailing ``/``, no ``.`` or ``..``
    segments, no backslashes or NUL, no segment starting with the temporary-file prefix ``.tmp-``.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"blob key must be a non-empty string, got {key!r}")
    if "\\" in key or "\x00" in key:
        raise ValueError(f"blob key {key!r} must use '/' separators and contain no backslash or NUL")
    for segment in key.split("/"):
        if not segment or _BAD_SEGMENT.match(segment) or segment.startswith(_TMP_PREFIX):
            raise ValueError(
                f"blob key {key!r} has an invalid segment {segment!r} "
                "(empty, '.', '..', or starting with '.tmp-'; keys must not start or end with '/')"
            )
    return key


class BlobStore(ABC):
    """Flat key -> bytes store with ``/``-separated keys (a directory locally, a bucket prefix on S3)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically, replacing any previous object."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Return the object's bytes; raise ``BlobNotFoundError`` (a ``KeyError``) if absent."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True when an object is stored under ``key``."""

    @abstractmethod
    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[str]:
        """Sorted keys that start with ``prefix`` (plain string prefix, as on S3); with ``start_after``
        only the keys sorting after it (S3's ``StartAfter``: one request for the tail of a log)."""

    @abstractmethod
    def delete(self, key: str, *, missing_ok: bool = False) -> None:
        """Remove the object; raise ``BlobNotFoundError`` if absent unless ``missing_ok``."""

    @abstractmethod
    def uri(self, key: str) -> str:
        """A URI naming the object (``file:///...`` locally, ``s3://bucket/...`` on S3)."""


class LocalBlobStore(BlobStore):
    """Objects as files under ``root``; key ``a/b/c`` is the file ``root/a/b/c``.

    ``put_bytes`` writes a temporary file in the destination directory, fsyncs it and renames it over
    the destination with ``os.replace``, so a crash mid-write never leaves a partial object.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def sweep_temporaries(self, older_than_s: float = 3600.0) -> int:
        """Remove temporary files a killed writer left (a SIGKILL between ``mkstemp`` and the rename);
        only old ones, since other processes may be writing into the same store right now."""
        import time

        cutoff, n = time.time() - older_than_s, 0
        for tmp in self.root.rglob(f"{_TMP_PREFIX}*"):
            try:
                if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    n += 1
            except FileNotFoundError:  # renamed or removed meanwhile
                pass
        return n

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def put_bytes(self, key: str, data: bytes) -> None:
        write_bytes_atomic(self._path(key), data, tmp_prefix=_TMP_PREFIX)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise BlobNotFoundError(key, str(self.root)) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[str]:
        # Walk only the deepest directory the prefix names completely, then filter by string prefix.
        parts = prefix.split("/")
        base = self.root.joinpath(*[p for p in parts[:-1] if p])
        if not base.is_dir():
            return []
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(_TMP_PREFIX)]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            rel = "" if rel == "." else rel + "/"
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = rel + name
                if key.startswith(prefix) and (start_after is None or key > start_after):
                    keys.append(key)
        keys.sort()
        return keys

    def delete(self, key: str, *, missing_ok: bool = False) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            if not missing_ok:
                raise BlobNotFoundError(key, str(self.root)) from None

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()
