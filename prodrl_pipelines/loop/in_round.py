"""The in-round resume state, mirrored to the blob store so a resume need not find it on this disk.

The trainer writes its resume state under ``checkpoints_root/.in-round/`` (one file for one process,
a sharded directory for FSDP2 ranks). After every save it is uploaded whole under a fresh prefix,
``in-round/<name>/<upload>/...``, and only then is ``in-round/<name>/latest.json`` pointed at that
upload (the previous one is deleted): a crash mid-upload leaves the previous state readable. At the
start of a round the state is downloaded back when the local copy is missing (another node, a new
pod), and both copies are removed once the round's checkpoint is written.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from prodrl_pipelines.storage import documents
from prodrl_pipelines.storage.blobstore import BlobStore

PREFIX = "in-round/"


def _pointer(path: Path) -> str:
    return f"{PREFIX}{path.name}/latest.json"


def _files(path: Path) -> list[str]:
    """Relative names of the state's files (the file itself for a one-process state)."""
    if path.is_file():
        return [""]
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def push(blobs: BlobStore, path: Path) -> None:
    """Upload the resume state just written at ``path``, then point ``latest.json`` at it."""
    upload = uuid.uuid4().hex[:12]
    names = _files(path)
    for rel in names:
        blobs.put_bytes(f"{PREFIX}{path.name}/{upload}/{rel or path.name}", (path / rel if rel else path).read_bytes())
    old = documents.get_json(blobs, _pointer(path)) if blobs.exists(_pointer(path)) else None
    documents.put_json(blobs, _pointer(path), {"upload": upload, "files": names, "is_dir": path.is_dir()})
    if old:
        _delete_upload(blobs, path, old)


def pull(blobs: BlobStore, path: Path) -> bool:
    """Download the mirrored state to ``path`` when it is missing here; True when it was."""
    if path.exists() or not blobs.exists(_pointer(path)):
        return False
    ref = documents.get_json(blobs, _pointer(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.pull-{uuid.uuid4().hex[:8]}")
    for rel in ref["files"]:
        data = blobs.get_bytes(f"{PREFIX}{path.name}/{ref['upload']}/{rel or path.name}")
        target = tmp / rel if ref["is_dir"] else tmp
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    os.replace(tmp, path)
    return True


def drop(blobs: BlobStore, path: Path) -> None:
    """Remove the mirrored state (the round's checkpoint is written)."""
    if blobs.exists(_pointer(path)):
        ref = documents.get_json(blobs, _pointer(path))
        blobs.delete(_pointer(path), missing_ok=True)
        _delete_upload(blobs, path, ref)


def _delete_upload(blobs: BlobStore, path: Path, ref: dict) -> None:
    for rel in ref["files"]:
        blobs.delete(f"{PREFIX}{path.name}/{ref['upload']}/{rel or path.name}", missing_ok=True)

