"""Directories that appear whole or not at all (checkpoints, exports)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


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
