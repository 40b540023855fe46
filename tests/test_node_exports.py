"""deploy_targets.node_exports: a Ray node that does not see the deploying disk reads the export from
the exports store (moto S3 server: conftest.s3_endpoint), into a verified, atomically written cache."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from pathlib import Path

import pytest

pytest.importorskip("boto3")

from prodrl_pipelines.config.settings import Settings  # noqa: E402
from prodrl_pipelines.deploy_targets.base import DeployError  # noqa: E402
from prodrl_pipelines.deploy_targets.node_exports import cache_dir, export_source, locate  # noqa: E402
from prodrl_pipelines.loop.services import build_services, publish_export  # noqa: E402
from prodrl_pipelines.storage.checkpoints import MANIFEST_NAME, S3CheckpointStore  # noqa: E402
from prodrl_pipelines.storage.locations import StoreLocation  # noqa: E402

RKEY = "round-000001"


@pytest.fixture(scope="module")
def bf16_export(tiny_policy_dir, tmp_path_factory) -> Path:
    from prodrl_pipelines.quant.export import export_policy

    out = tmp_path_factory.mktemp("node_export") / "bf16"
    export_policy(tiny_policy_dir, out, "bf16")
    return out


@pytest.fixture
def published(s3_endpoint, bucket, bf16_export, tmp_path):
    """The export published to the S3 exports store as a round does (``<home>/exports/<rkey>``, publish_export)."""
    settings = Settings(home=str(tmp_path / "home"))
    loc = StoreLocation(s3_bucket=bucket, s3_prefix="prod", s3_endpoint_url=s3_endpoint)
    export_dir = settings.exports_root / RKEY
    shutil.copytree(bf16_export, export_dir)
    publish_export(build_services(settings, loc), RKEY, export_dir)
    return settings, loc, export_dir


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


@pytest.fixture
def downloads(monkeypatch) -> list[str]:
    """Keys of the export files the store downloads (manifest reads not counted)."""
    got, real = [], S3CheckpointStore._get_file
    monkeypatch.setattr(S3CheckpointStore, "_get_file", lambda self, key, path: (got.append(key), real(self, key, path)))
    return got


def test_source_describes_the_store_without_credentials(published, s3_endpoint, bucket):
    settings, loc, export_dir = published
    src = export_source(settings, export_dir, loc)
    assert json.loads(json.dumps(src)) == src == {
        "store": "s3", "bucket": bucket, "prefix": "prod", "kind": "exports", "name": RKEY,
        "endpoint_url": s3_endpoint, "region": "", "uri": f"s3://{bucket}/prod/exports/{RKEY}"}
    assert "testing" not in json.dumps(src)  # the fake AWS keys reach nodes through their environment only
    assert export_source(settings, export_dir, StoreLocation()) is None  # local files: nothing to fetch


def test_node_without_the_disk_fetches_reuses_and_repairs(published, downloads, tmp_path):
    settings, loc, export_dir = published
    src, cache = export_source(settings, export_dir, loc), tmp_path / "node-cache"
    elsewhere = str(tmp_path / "other-node" / "exports" / RKEY)  # the deploying path, absent on this node

    got = Path(locate(elsewhere, src, str(cache)))
    assert got == cache_dir(src, cache) / RKEY and _files(got) == _files(export_dir)
    n_files = len(downloads)
    assert n_files == len(_files(export_dir)) > 1

    assert locate(elsewhere, src, str(cache)) == str(got) and len(downloads) == n_files  # reused, no download

    # Chosen behaviour for a damaged cached copy: re-fetch (a same-size bit flip is caught by sha256)
    victim = max(got.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    assert locate(elsewhere, src, str(cache)) == str(got) and len(downloads) == 2 * n_files
    assert _files(got) == _files(export_dir)
    assert sorted(p.name for p in got.parent.iterdir()) == [f".{RKEY}.lock", RKEY]  # no temporary leftovers


def test_existing_path_is_returned_as_is(published, downloads, tmp_path):
    settings, loc, export_dir = published
    src = export_source(settings, export_dir, loc)
    assert locate(str(export_dir), src, str(tmp_path / "c")) == str(export_dir)
    assert locate(str(export_dir), None) == str(export_dir)
    assert downloads == [] and not (tmp_path / "c").exists()


def test_no_source_and_no_path_names_what_to_configure(tmp_path):
    missing = str(tmp_path / "exports" / RKEY)
    with pytest.raises(DeployError) as e:
        locate(missing, None, str(tmp_path / "c"))
    msg = str(e.value)
    assert missing in msg and socket.gethostname() in msg and "PRODRL_S3_BUCKET" in msg


def test_unpublished_export_names_the_store(s3_endpoint, bucket, tmp_path):
    src = export_source(None, tmp_path / "round-000009", StoreLocation(s3_bucket=bucket, s3_endpoint_url=s3_endpoint))
    with pytest.raises(DeployError, match=f"s3://{bucket}/exports/round-000009"):
        locate(str(tmp_path / "round-000009"), src, str(tmp_path / "c"))


def test_bad_store_copy_raises_and_leaves_no_half_copy(published, tmp_path):
    settings, loc, export_dir = published
    src = export_source(settings, export_dir, loc)
    store = loc.checkpoint_store(settings, "exports")
    m = store.manifest(RKEY)
    entry = max(m["files"], key=lambda e: e["size"])
    key = f"{m['files_prefix']}/{entry['path']}"
    orig = store.blobs.get_bytes(key)
    store.blobs.put_bytes(key, bytes([orig[0] ^ 1]) + orig[1:])  # same size, different content
    with pytest.raises(DeployError, match=rf"{entry['path']} has sha256"):
        locate(str(tmp_path / "absent" / RKEY), src, str(tmp_path / "c"))
    assert [p.name for p in cache_dir(src, tmp_path / "c").iterdir()] == [f".{RKEY}.lock"]


def test_concurrent_locates_share_one_copy(published, downloads, tmp_path):
    settings, loc, export_dir = published
    src, cache, absent = export_source(settings, export_dir, loc), str(tmp_path / "c"), str(tmp_path / "x" / RKEY)
    results, errors, start = [], [], threading.Barrier(2)

    def replica():
        start.wait()
        try:
            results.append(locate(absent, src, cache))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=replica) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert len(downloads) == len(_files(export_dir))  # fetched once; the other replica reused it
    got = Path(results[0])
    assert _files(got) == _files(export_dir)
    assert sorted(p.name for p in got.parent.iterdir()) == [f".{RKEY}.lock", RKEY]


def test_a_killed_fetchs_leftover_goes_and_the_cache_keeps_the_newest_exports(published, tmp_path):
    """A fetch killed half-way leaves ``.<name>.tmp-*``: the next fetch of that name removes it. After
    each fetch a node keeps the ``KEEP`` most recent exports of the store (the new one always)."""
    import os
    import time

    from prodrl_pipelines.deploy_targets import node_exports

    settings, loc, export_dir = published
    cache_root = tmp_path / "c"
    store = loc.checkpoint_store(settings, "exports")
    names = [f"round-00000{i}" for i in range(2, 2 + node_exports.KEEP + 1)]
    for name in names:
        store.publish(export_dir, name)
    src = {**export_source(settings, export_dir, loc), "uri": ""}
    cache = cache_dir(src, cache_root)
    half = cache / f".{names[0]}.tmp-deadbeef"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"half a file")
    got = []
    for i, name in enumerate(names):
        got.append(locate(str(tmp_path / "elsewhere" / name), {**src, "name": name}, str(cache_root)))
        os.utime(got[-1], (time.time() + i, time.time() + i))  # fetched in this order, whatever the clock
    assert not half.exists()
    kept = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
    assert kept == names[-node_exports.KEEP:], kept  # the oldest went
    assert _files(Path(got[-1])) == _files(export_dir)
