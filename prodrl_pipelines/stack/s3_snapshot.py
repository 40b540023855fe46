"""Keep the stack's S3 bucket across restarts: the endpoint (moto) holds objects in memory only.

On stop the bucket is mirrored into ``<home>/s3_snapshot`` (only objects whose ETag changed are
downloaded; objects deleted from the bucket are deleted from the mirror; the index is written last,
atomically); on start the mirror is uploaded into the fresh endpoint. A stack killed with SIGKILL
keeps the previous snapshot, so it loses what was written to S3 since then.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from prodrl_pipelines.storage.atomic import write_json_atomic

INDEX = "index.json"


def _local_name(key: str) -> str:
    # keys may nest arbitrarily ("a" and "a/b" can both exist): store flat, by hash
    return hashlib.sha1(key.encode()).hexdigest()


def _index(root: Path) -> dict[str, dict]:
    p = root / INDEX
    return json.loads(p.read_text()) if p.exists() else {}


def save(client, bucket: str, root: Path) -> dict:
    """Mirror ``bucket`` into ``root``; returns counts (objects, downloaded, deleted, bytes)."""
    objs_dir = root / "objects"
    objs_dir.mkdir(parents=True, exist_ok=True)
    old = _index(root)
    new: dict[str, dict] = {}
    downloaded = size = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            key, etag = o["Key"], o["ETag"]
            name = _local_name(key)
            new[key] = {"etag": etag, "file": name, "size": o["Size"]}
            size += o["Size"]
            if old.get(key, {}).get("etag") == etag and (objs_dir / name).exists():
                continue
            tmp = objs_dir / f".{name}.tmp"
            client.download_file(bucket, key, str(tmp))
            os.replace(tmp, objs_dir / name)
            downloaded += 1
    write_json_atomic(root / INDEX, new, indent=None, durable=False)
    deleted = 0
    for key, meta in old.items():
        if key not in new:
            (objs_dir / meta["file"]).unlink(missing_ok=True)
            deleted += 1
    return {"objects": len(new), "downloaded": downloaded, "deleted": deleted, "bytes": size}


def restore(client, bucket: str, root: Path) -> int:
    """Upload the mirror in ``root`` (if any) into ``bucket``; returns the number of objects."""
    index = _index(root)
    for key, meta in index.items():
        client.upload_file(str(root / "objects" / meta["file"]), bucket, key)
    return len(index)
