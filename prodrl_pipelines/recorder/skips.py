"""The recorder's skipped calls: an answered call that could not be recorded still takes its call
index, kept as small JSON parts under ``_recorder/skipped/`` (one per flush that had skips).

A start needs them all (the next index of every trajectory, and replaying the write-ahead log
exactly once), but not one object per flush ever written: ``load_skips`` folds the parts it read
into one, so a start reads that part plus the ones flushed since the last start. The folded part
is written before the parts it replaces are deleted, so a recorder starting at the same moment
reads either the old parts or the folded one (a part gone between its LIST and GET: it lists again).
"""

from __future__ import annotations

import json

from prodrl_pipelines.storage.blobstore import BlobNotFoundError, BlobStore
from prodrl_pipelines.trajectories.rows import uuid7

SKIPPED_PREFIX = "_recorder/skipped/"


def write_skips(blobs: BlobStore, skips: list[dict]) -> None:
    blobs.put_bytes(f"{SKIPPED_PREFIX}part-{uuid7()}.json", json.dumps(skips).encode())


def load_skips(blobs: BlobStore, attempts: int = 5) -> list[dict]:
    """Every stored skip (each once), after folding the parts read into one."""
    for _ in range(attempts):
        keys = blobs.list(SKIPPED_PREFIX)
        try:
            parts = [json.loads(blobs.get_bytes(k)) for k in keys]
        except BlobNotFoundError:
            continue  # another recorder folded them meanwhile: its part is in the next listing
        seen, skips = set(), []
        for s in (s for part in parts for s in part):
            key = json.dumps(s, sort_keys=True)
            if key not in seen:
                seen.add(key)
                skips.append(s)
        if len(keys) > 1:
            write_skips(blobs, skips)
            for k in keys:
                blobs.delete(k, missing_ok=True)
        return skips
    raise RuntimeError(f"the recorder's skipped calls under {SKIPPED_PREFIX!r} kept changing while read "
                       f"({attempts} attempts)")
