"""Files and directories that appear whole or not at all: one way to write them.

``write_text_atomic`` / ``write_json_atomic`` write a sibling temporary file, fsync it and rename it
into place (readers never see half a file; a crash leaves the old file); ``atomic_directory`` does
the same for a directory (checkpoints, exports).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist a rename by fsyncing its directory (best effort: not all platforms allow it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes, *, mode: int = 0o666, durable: bool = True,
                       tmp_prefix: str = ".") -> None:
    """Replace ``path`` with ``data`` atomically; ``durable`` fsyncs the file and its directory;
    ``mode`` is the permission the file is created with (0o600 for private files); ``tmp_prefix``
    names the temporary sibling (a store that sweeps stale temporaries looks for its prefix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{tmp_prefix}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str, **kw) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), **kw)


def write_json_atomic(path: Path, obj, *, indent: int = 1, **kw) -> None:
    """``obj`` as JSON (sorted keys; non-JSON values through ``str``), written atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=True, default=str), **kw)


def atomic_directory(final: Path):
    """Context manager yielding a temp dir that replaces ``final`` only if the block succeeds."""

    class _Atomic:
        def __enter__(self_inner) -> Path:
            final.parent.mkdir(parents=True, exist_ok=True)
            self_inner.tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
            self_inner.tmp.mkdir()
            return self_inner.tmp

        def __exit__(self_inner, exc_type, exc, tb):
            if exc_type is not None:
                shutil.rmtree(self_inner.tmp, ignore_errors=True)
                return False
            if final.exists():  # re-materialisation: replace the previous attempt as a whole
                old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(final, old)
                os.replace(self_inner.tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self_inner.tmp, final)
            return False

    return _Atomic()
