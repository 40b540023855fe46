"""The in-round resume state, kept in the blob store so that any machine can resume the round.

The trainer writes its resume state under ``checkpoints_root/.in-round/`` on its own disk, and after
every save the state goes to the store: uploaded under a fresh prefix, ``in-round/<name>/<upload>/``,
and only then is ``in-round/<name>/latest.json`` pointed at that upload (the previous one is
deleted), so a crash mid-upload leaves the previous state readable.

- One process: one file, pushed and pulled whole (``push``, ``pull``); the local copy is used when
  the store has none.
- FSDP2 ranks: each rank writes its part into a directory of its own (``rank<r>/``: the ranks may
  be on machines that share no disk) and uploads its own files under the save's upload; once every
  rank has, rank 0 points ``latest.json`` at it (``upload_part``, ``publish``). A resume starts from
  the store's state only: every rank replaces its directory with the whole upload (``pull`` with
  ``whole=True``), so all ranks read the same, complete checkpoint wherever they run.

Both copies are removed once the round's checkpoint is written (``drop``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from prodrl_pipelines.storage import documents
from prodrl_pipelines.storage.blobstore import BlobStore

PREFIX = "in-round/"


def new_upload() -> str:
    return uuid.uuid4().hex[:12]


def _pointer(name: str) -> str:
    return f"{PREFIX}{name}/latest.json"


def _files(path: Path) -> list[str]:
    """Relative names of the state's files (the file itself for a one-process state)."""
    if path.is_file():
        return [""]
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def _key(name: str, upload: str, rel: str) -> str:
    return f"{PREFIX}{name}/{upload}/{rel or name}"


def upload_part(blobs: BlobStore, path: Path, name: str, upload: str) -> list[str]:
    """Upload the files under ``path`` as part of ``upload`` of state ``name``; their relative names."""
    names = _files(path)
    for rel in names:
        blobs.put_bytes(_key(name, upload, rel), (path / rel if rel else path).read_bytes())
    return names


def publish(blobs: BlobStore, name: str, upload: str, files: list[str], is_dir: bool) -> None:
    """Point ``latest.json`` of ``name`` at ``upload`` (every file of it uploaded), then delete every
    other upload of ``name``: the previous state, and parts of saves that crashed before publishing."""
    documents.put_json(blobs, _pointer(name), {"upload": upload, "files": sorted(files), "is_dir": is_dir})
    keep = f"{PREFIX}{name}/{upload}/"
    for key in blobs.list(f"{PREFIX}{name}/"):
        if not key.startswith(keep) and key != _pointer(name):
            blobs.delete(key, missing_ok=True)


def push(blobs: BlobStore, path: Path, name: str | None = None) -> None:
    """Upload the resume state just written at ``path`` whole, then point ``latest.json`` at it."""
    name, upload = name or path.name, new_upload()
    publish(blobs, name, upload, upload_part(blobs, path, name, upload), path.is_dir())


def pull(blobs: BlobStore, path: Path, name: str | None = None, *, whole: bool = False) -> bool:
    """Download the stored state of ``name`` to ``path``; True when it was. Without ``whole``, only when
    ``path`` is missing here (a local copy is as new as the store's). With ``whole``, the store's state
    replaces whatever is at ``path``, and without one in the store ``path`` is removed: a rank's own
    directory holds only its part of a save, never a state to resume from on its own."""
    name = name or path.name
    if not blobs.exists(_pointer(name)):
        if whole:
            _remove(path)
        return False
    if path.exists() and not whole:
        return False
    ref = documents.get_json(blobs, _pointer(name))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.pull-{uuid.uuid4().hex[:8]}")
    for rel in ref["files"]:
        data = blobs.get_bytes(_key(name, ref["upload"], rel))
        target = tmp / rel if ref["is_dir"] else tmp
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    _remove(path)
    os.replace(tmp, path)
    return True


def drop(blobs: BlobStore, name: str) -> None:
    """Remove the stored state (the round's checkpoint is written), pointer last."""
    for key in blobs.list(f"{PREFIX}{name}/"):
        if key != _pointer(name):
            blobs.delete(key, missing_ok=True)
    blobs.delete(_pointer(name), missing_ok=True)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
