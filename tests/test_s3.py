"""S3 blob store and checkpoint store against a real S3-compatible HTTP server (moto: conftest.s3_endpoint).

A small loopback proxy in front of it injects faults (HTTP 503, dropped connections) to test the
retries and the errors raised once they are used up.
"""

from __future__ import annotations

import http.client
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

boto3 = pytest.importorskip("boto3")

from prodrl_pipelines.storage import documents
from prodrl_pipelines.storage.checkpoints import (  # noqa: E402
    MANIFEST_NAME,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    LocalCheckpointStore,
    S3CheckpointStore,
)
from prodrl_pipelines.storage.blobstore import BlobNotFoundError, LocalBlobStore  # noqa: E402
from prodrl_pipelines.storage.s3 import S3BlobStore, S3BlobStoreError  # noqa: E402
from prodrl_pipelines.trajectories.store import TrajectoryStore  # noqa: E402
from helpers import make_reward, make_trajectory  # noqa: E402

MiB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(endpoint: str, bucket: str, prefix: str = "prod", **kw) -> S3BlobStore:
    return S3BlobStore(bucket, prefix, endpoint_url=endpoint, **kw)


# ----------------------------------------------------------------------------- fault proxy


class FaultProxy:
    """Forwards HTTP to the S3 server; ``fail`` decides per request whether to answer 503 instead,
    ``drop`` whether to close the connection without an answer."""

    def __init__(self, target: str) -> None:
        self.target_port = int(target.rsplit(":", 1)[1])
        self.requests: list[tuple[str, str]] = []
        self.injected = 0
        self.fail_next = 0
        self.fail = lambda method, path: False
        self.drop_next = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self):
                body = self._body()
                method, path = self.command, self.path
                with proxy.lock:
                    proxy.requests.append((method, path))
                    drop = proxy.drop_next > 0
                    if drop:
                        proxy.drop_next -= 1
                    fail = not drop and (proxy.fail_next > 0 or proxy.fail(method, path))
                    if fail:
                        proxy.fail_next = max(0, proxy.fail_next - 1)
                    if drop or fail:
                        proxy.injected += 1
                if drop:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fail:
                    payload = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>ServiceUnavailable</Code>"
                               b"<Message>injected by the test proxy</Message></Error>")
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(payload)
                    return
                hop = {"connection", "keep-alive", "transfer-encoding", "expect", "content-length", "host"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                headers["Host"] = self.headers.get("Host", "")
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=30)
                try:
                    conn.request(method, path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in hop:
                            self.send_header(k, v)
                    if method == "HEAD":
                        self.send_header("Content-Length", resp.getheader("Content-Length", "0"))
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultProxy(s3_endpoint)
    yield p
    p.close()


# ----------------------------------------------------------------------------- blob store


def test_put_get_exists_list_delete(s3_endpoint, bucket):
    s = _store(s3_endpoint, bucket, "prod/run1")
    assert s.list() == [] and not s.exists("a/b.json")
    s.put_bytes("a/b.json", b"one")
    s.put_bytes("a/b.json", b"two")  # replaced
    s.put_bytes("a/c/d.bin", bytes(range(256)))
    s.put_bytes("ab/e", b"")
    assert s.get_bytes("a/b.json") == b"two"
    assert s.get_bytes("a/c/d.bin") == bytes(range(256))
    assert s.get_bytes("ab/e") == b""
    assert s.exists("a/b.json") and not s.exists("a/b")
    assert s.list() == ["a/b.json", "a/c/d.bin", "ab/e"]
    assert s.list("a/") == ["a/b.json", "a/c/d.bin"]
    assert s.list("a") == ["a/b.json", "a/c/d.bin", "ab/e"]  # a plain string prefix, as locally
    assert s.list("zz") == []
    assert s.uri("a/b.json") == f"s3://{bucket}/prod/run1/a/b.json"
    # objects sit under the prefix with the local store's layout
    raw = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    assert sorted(o["Key"] for o in raw) == ["prod/run1/a/b.json", "prod/run1/a/c/d.bin", "prod/run1/ab/e"]

    with pytest.raises(BlobNotFoundError) as ei:
        s.get_bytes("a/missing")
    assert isinstance(ei.value, KeyError) and "a/missing" in str(ei.value) and bucket in str(ei.value)
    s.delete("a/b.json")
    assert not s.exists("a/b.json")
    with pytest.raises(BlobNotFoundError):
        s.delete("a/b.json")
    s.delete("a/b.json", missing_ok=True)
    for bad in ("", "/a", "a/", "a//b", "a/../b", ".tmp-x"):
        with pytest.raises(ValueError):
            s.put_bytes(bad, b"x")
    # another prefix in the same bucket is a separate store
    assert _store(s3_endpoint, bucket, "prod/run2").list() == []


def test_same_keys_as_local_store(s3_endpoint, bucket, tmp_path):
    local, s3 = LocalBlobStore(tmp_path / "store"), _store(s3_endpoint, bucket)
    keys = ["rounds/round-000001/batch.json", "deploy/live.json", "trajectories/policy_version=v%2F1/part-1.parquet",
            "rewards/part-2.parquet", "ledger/round=round-000001.parquet"]
    for i, k in enumerate(keys):
        local.put_bytes(k, f"{i}".encode())
        s3.put_bytes(k, f"{i}".encode())
    for prefix in ("", "rounds/", "trajectories/policy_version=", "r", "deploy/live.json", "nope/"):
        assert s3.list(prefix) == local.list(prefix)
    assert [s3.get_bytes(k) for k in keys] == [local.get_bytes(k) for k in keys]


def test_list_follows_pagination(s3_endpoint, bucket):
    s = _store(s3_endpoint, bucket, "p", list_page_size=3)
    keys = sorted(f"k/{i:03d}" for i in range(10)) + ["l/x"]
    for k in keys:
        s.put_bytes(k, b"x")
    calls = []
    s.client.meta.events.register("before-parameter-build.s3.ListObjectsV2", lambda **kw: calls.append(kw["params"]))
    assert s.list("k/") == keys[:-1]
    assert len(calls) == 4  # ceil(10 / 3) pages, each asking for at most 3 keys
    assert all(c.get("MaxKeys") == 3 for c in calls)
    calls.clear()
    assert s.list() == keys
    assert len(calls) == 4
    with pytest.raises(ValueError):
        _store(s3_endpoint, bucket, list_page_size=1001)


def test_multipart_upload_and_download(s3_endpoint, bucket, tmp_path):
    s = _store(s3_endpoint, bucket, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2)
    data = np.random.default_rng(0).integers(0, 256, 11 * MiB, dtype=np.uint8).tobytes()
    s.put_bytes("big/blob.bin", data)
    head = s.client.head_object(Bucket=bucket, Key="prod/big/blob.bin")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5 + 5 + 1 MiB
    assert s.get_bytes("big/blob.bin") == data
    src = tmp_path / "src.bin"
    src.write_bytes(data[: 6 * MiB])
    s.put_file("big/file.bin", src)
    assert s.client.head_object(Bucket=bucket, Key="prod/big/file.bin")["ETag"].strip('"').endswith("-2")
    out = tmp_path / "out.bin"
    s.get_file("big/file.bin", out)
    assert out.read_bytes() == data[: 6 * MiB]
    with pytest.raises(BlobNotFoundError):
        s.get_file("big/missing.bin", tmp_path / "missing.bin")


def test_trajectory_store_roundtrip_identical_to_local(s3_endpoint, bucket, tmp_path):
    from prodrl_pipelines.trajectories.selection import select_round_dataset

    rows = [r for i in range(6) for r in make_trajectory(f"t{i}", n_calls=2, minutes=i, seed=i)]
    rows += make_trajectory("t-other", policy_version="v/1", n_calls=1)
    rows += [dict(rows[0])]  # a duplicate call
    bad = make_trajectory("t-bad", n_calls=1, minutes=9)
    bad[0]["output_logprobs"] = [float("nan")] * len(bad[0]["output_token_ids"])
    rewards = [make_reward(f"t{i}", float(i % 3), minutes=i) for i in range(6)] + [make_reward("t-bad", 1.0)]
    rewards += [make_reward("t0", 5.0, minutes=30)]  # a later reward for t0 wins

    results = []
    for store in (TrajectoryStore(LocalBlobStore(tmp_path / "local")), TrajectoryStore(_store(s3_endpoint, bucket))):
        store.write_calls(rows + bad)
        store.write_rewards(rewards)
        documents.put_json(store.blobs, "rounds/round-000001/doc.json", {"a": 1, "b": [1.5, None]})
        sel = select_round_dataset(store, "round-000001", live_version="v0", version_order=["v0", "v/1"],
                                   max_policy_lag=0, n_required=4, vocab_size=50, seed=0)
        results.append({
            "versions": store.policy_versions(),
            "calls": store.read_calls().sort_by([("trajectory_id", "ascending"), ("call_index", "ascending")]),
            "calls_all": store.read_calls(dedupe=False).num_rows,
            "rewards": store.read_rewards().sort_by("trajectory_id"),
            "doc": documents.get_json(store.blobs, "rounds/round-000001/doc.json"),
            "dataset": sel.dataset.sort_by([("trajectory_id", "ascending"), ("call_index", "ascending")]),
            "quarantined": dict(sel.quarantine_counts),
            "ledger": store.read_ledger("round-000001").sort_by("trajectory_id"),
            "quarantine": store.read_quarantine("round-000001").num_rows,
            "used": store.used_trajectory_ids(),
        })
    loc, rem = results
    assert loc["versions"] == rem["versions"] == ["v/1", "v0"]
    for k in ("calls", "rewards", "dataset", "ledger"):
        assert repr(loc[k].to_pylist()) == repr(rem[k].to_pylist()), k  # repr: the bad row's NaNs compare equal
    for k in ("calls_all", "doc", "quarantined", "quarantine", "used"):
        assert loc[k] == rem[k], k
    assert loc["dataset"].num_rows == 8 and loc["quarantine"] >= 1


# ----------------------------------------------------------------------------- retries and errors


@pytest.mark.parametrize("mode", ["standard", "adaptive"])
def test_transient_503s_are_retried(proxy, bucket, mode):
    s = _store(proxy.url, bucket, max_attempts=4, retry_mode=mode)
    proxy.fail_next = 2
    s.put_bytes("x/y", b"payload")
    assert proxy.injected == 2
    assert [m for m, _ in proxy.requests] == ["PUT", "PUT", "PUT"]
    proxy.fail_next = 3
    assert s.get_bytes("x/y") == b"payload"
    proxy.fail_next = 3
    assert s.list("x/") == ["x/y"]
    proxy.fail_next = 1
    assert s.exists("x/y")
    assert proxy.injected == 9


def test_dropped_connections_are_retried(proxy, bucket):
    s = _store(proxy.url, bucket, max_attempts=3)
    s.put_bytes("k", b"v")
    proxy.drop_next = 2
    assert s.get_bytes("k") == b"v"
    assert proxy.injected == 2


def test_persistent_failure_names_bucket_and_key(proxy, bucket):
    s = _store(proxy.url, bucket, "pre", max_attempts=3)
    s.put_bytes("rounds/r1/batch.json", b"{}")
    proxy.fail = lambda method, path: True
    n0 = len(proxy.requests)
    with pytest.raises(S3BlobStoreError) as ei:
        s.get_bytes("rounds/r1/batch.json")
    e = ei.value
    assert e.bucket == bucket and e.key == "pre/rounds/r1/batch.json" and e.attempts == 3
    assert bucket in str(e) and "pre/rounds/r1/batch.json" in str(e) and "3 attempts" in str(e)
    assert "503" in str(e) and "get" in str(e)
    assert len(proxy.requests) - n0 == 3
    for op in (lambda: s.put_bytes("a/b", b"x"), lambda: s.exists("a/b"), lambda: s.list("a/"),
               lambda: s.delete("a/b", missing_ok=True)):
        with pytest.raises(S3BlobStoreError, match=bucket):
            op()


def test_unreachable_endpoint_and_missing_bucket(s3_endpoint):
    dead = _store(f"http://127.0.0.1:{_free_port()}", "some-bucket", max_attempts=2, connect_timeout=1)
    with pytest.raises(S3BlobStoreError) as ei:
        dead.get_bytes("a/b")
    assert "some-bucket" in str(ei.value) and "prod/a/b" in str(ei.value)
    with pytest.raises(S3BlobStoreError, match="NoSuchBucket") as ei:
        _store(s3_endpoint, f"absent-{uuid.uuid4().hex[:8]}").put_bytes("a/b", b"x")
    assert "absent-" in str(ei.value)


def test_settings_validation_and_pickling(s3_endpoint, bucket):
    import pickle

    for kw in ({"retry_mode": "legacy"}, {"max_attempts": 0}, {"multipart_chunksize": MiB}):
        with pytest.raises(ValueError):
            _store(s3_endpoint, bucket, **kw)
    with pytest.raises(ValueError):
        S3BlobStore("", "p")
    s = _store(s3_endpoint, bucket, "/p/q/")
    assert s.prefix == "p/q"
    s.put_bytes("k", b"v")
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.get_bytes("k") == b"v"


def test_store_location_opens_local_or_s3(s3_endpoint, bucket, tmp_path):
    from prodrl_pipelines.config.settings import Settings
    from prodrl_pipelines.resources.settings import StoreResource
    from prodrl_pipelines.storage.locations import StoreLocation

    settings = Settings(home=str(tmp_path / "home"))
    assert StoreResource(s3_bucket=bucket, s3_prefix="x").location() == StoreLocation(s3_bucket=bucket, s3_prefix="x")
    local = StoreLocation()
    assert isinstance(local.blobs(settings), LocalBlobStore)
    assert local.checkpoint_store(settings).root == settings.checkpoints_root
    assert local.checkpoint_store(settings, "exports").root == settings.exports_root
    remote = StoreLocation(s3_bucket=bucket, s3_prefix="team/prodrl", s3_endpoint_url=s3_endpoint)
    blobs = remote.blobs(settings)
    assert isinstance(blobs, S3BlobStore) and blobs.bucket == bucket and blobs.prefix == "team/prodrl"
    blobs.put_bytes("deploy/live.json", b"{}")
    assert remote.blobs(settings).get_bytes("deploy/live.json") == b"{}"
    ck = remote.checkpoint_store(settings, "exports")
    assert isinstance(ck, S3CheckpointStore) and ck.prefix == "exports"
    with pytest.raises(ValueError):
        remote.checkpoint_store(settings, "other")


# ----------------------------------------------------------------------------- checkpoint store


def _checkpoint_dir(path: Path, seed: int = 0, big: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text(f'{{"vocab_size": 160, "seed": {seed}}}')
    (path / "model.safetensors").write_bytes(rng.integers(0, 256, 4096 + big, dtype=np.uint8).tobytes())
    (path / "trainer_state.pt").write_bytes(rng.integers(0, 256, 1000, dtype=np.uint8).tobytes())
    (path / "sub" / "tokenizer.json").write_text('{"t": %d}' % seed)
    return path


def _same_files(a: Path, b: Path) -> bool:
    fa = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    fb = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    return fa == fb and all((a / f).read_bytes() == (b / f).read_bytes() for f in fa)


def test_s3_checkpoint_publish_fetch(s3_endpoint, bucket, tmp_path):
    blobs = _store(s3_endpoint, bucket, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    ck = S3CheckpointStore(blobs, "checkpoints")
    src = _checkpoint_dir(tmp_path / "src", big=6 * MiB)
    assert not ck.exists("round-000001") and ck.names() == []
    with pytest.raises(CheckpointNotFoundError, match="round-000001"):
        ck.fetch("round-000001", tmp_path / "cache")
    uri = ck.publish(src, "round-000001")
    assert ck.exists("round-000001") and ck.names() == ["round-000001"]
    m = ck.manifest("round-000001")
    assert uri == ck.uri("round-000001") == f"s3://{bucket}/prod/{m['files_prefix']}"
    assert sorted(e["path"] for e in m["files"]) == ["config.json", "model.safetensors", "sub/tokenizer.json",
                                                      "trainer_state.pt"]
    got = ck.fetch("round-000001", tmp_path / "cache")
    assert got == tmp_path / "cache" / "round-000001" and _same_files(src, got)
    assert (got / MANIFEST_NAME).is_file()

    # a second fetch reuses the verified copy (no object downloads)
    gets = []
    blobs.client.meta.events.register("before-parameter-build.s3.GetObject", lambda **kw: gets.append(kw["params"]["Key"]))
    assert ck.fetch("round-000001", tmp_path / "cache") == got
    assert gets == [f"prod/checkpoints/round-000001/{MANIFEST_NAME}"]

    # republishing replaces the checkpoint as a whole; the old upload's files are deleted
    src2 = _checkpoint_dir(tmp_path / "src2", seed=1)
    ck.publish(src2, "round-000001")
    assert ck.manifest("round-000001")["upload_id"] != m["upload_id"]
    assert not any(k.startswith(m["files_prefix"]) for k in blobs.list("checkpoints/"))
    assert _same_files(src2, ck.fetch("round-000001", tmp_path / "cache"))

    # exports live beside checkpoints under their own prefix
    ex = S3CheckpointStore(blobs, "exports")
    assert ex.names() == [] and not ex.exists("round-000001")


def test_s3_checkpoint_fetch_detects_corruption(s3_endpoint, bucket, tmp_path):
    blobs = _store(s3_endpoint, bucket)
    ck = S3CheckpointStore(blobs, "checkpoints")
    ck.publish(_checkpoint_dir(tmp_path / "src"), "base")
    m = ck.manifest("base")
    key = f"{m['files_prefix']}/model.safetensors"
    orig = blobs.get_bytes(key)
    blobs.put_bytes(key, bytes([orig[0] ^ 1]) + orig[1:])  # same size, different content
    with pytest.raises(CheckpointIntegrityError, match="sha256"):
        ck.fetch("base", tmp_path / "cache")
    assert not (tmp_path / "cache" / "base").exists()
    assert not [p for p in (tmp_path / "cache").iterdir()]  # no temporary leftovers
    blobs.delete(key)
    with pytest.raises(CheckpointIntegrityError, match="model.safetensors"):
        ck.fetch("base", tmp_path / "cache")


def test_s3_checkpoint_publish_is_atomic(proxy, bucket, tmp_path):
    """A failure mid-upload leaves no visible checkpoint, and a published one stays intact."""
    blobs = _store(proxy.url, bucket, max_attempts=2)
    ck = S3CheckpointStore(blobs, "checkpoints")
    src = _checkpoint_dir(tmp_path / "src")
    proxy.fail = lambda method, path: method == "PUT" and path.split("?")[0].endswith("/sub/tokenizer.json")
    with pytest.raises(S3BlobStoreError, match="tokenizer.json"):
        ck.publish(src, "round-000002")
    assert not ck.exists("round-000002") and ck.names() == []
    with pytest.raises(CheckpointNotFoundError):
        ck.fetch("round-000002", tmp_path / "cache")
    assert blobs.list("checkpoints/") == []  # the partial upload was cleaned up

    proxy.fail = lambda method, path: False
    ck.publish(src, "round-000002")
    before = ck.manifest("round-000002")
    src2 = _checkpoint_dir(tmp_path / "src2", seed=5)
    # the commit point fails: the manifest PUT
    proxy.fail = lambda method, path: method == "PUT" and path.split("?")[0].endswith(MANIFEST_NAME)
    with pytest.raises(S3BlobStoreError, match=MANIFEST_NAME):
        ck.publish(src2, "round-000002")
    proxy.fail = lambda method, path: False
    assert ck.manifest("round-000002") == before
    assert _same_files(src, ck.fetch("round-000002", tmp_path / "cache"))
    assert all(k.startswith(before["files_prefix"]) or k.endswith(MANIFEST_NAME) for k in blobs.list("checkpoints/"))


def test_blob_checkpoint_store_on_local_blobs(tmp_path):
    """The object-store layout also works on a LocalBlobStore (no put_file/get_file: bytes path)."""
    ck = S3CheckpointStore(LocalBlobStore(tmp_path / "blobs"), "checkpoints")
    src = _checkpoint_dir(tmp_path / "src")
    ck.publish(src, "round-000003")
    assert _same_files(src, ck.fetch("round-000003", tmp_path / "cache"))
    assert ck.uri("round-000003").startswith("file://")
    with pytest.raises(ValueError):
        ck.publish(src, "a/b")
    with pytest.raises(ValueError, match="cache_dir"):
        ck.fetch("round-000003")


def test_local_checkpoint_store(tmp_path, monkeypatch):
    import prodrl_pipelines.storage.checkpoints as C

    store = LocalCheckpointStore(tmp_path / "checkpoints")
    # in place: what save_checkpoint wrote becomes visible once the manifest is there
    inplace = _checkpoint_dir(tmp_path / "checkpoints" / "round-000001")
    assert not store.exists("round-000001") and store.names() == []
    with pytest.raises(CheckpointNotFoundError):
        store.fetch("round-000001")
    assert store.publish(inplace, "round-000001") == inplace.as_uri()
    assert store.exists("round-000001") and store.fetch("round-000001", tmp_path / "unused") == inplace
    assert store.uri("round-000001") == inplace.as_uri()
    # copied from elsewhere, replacing as a whole
    src = _checkpoint_dir(tmp_path / "src", seed=3)
    store.publish(src, "round-000001")
    assert _same_files(src, store.fetch("round-000001"))
    assert not (store.path("round-000001") / "sub" / "tokenizer.json").read_text() == '{"t": 0}'
    # a failure while publishing leaves the previous version and no temporary directory
    src4 = _checkpoint_dir(tmp_path / "src4", seed=4)
    monkeypatch.setattr(C, "build_manifest", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        store.publish(src4, "round-000001")
    monkeypatch.undo()
    assert _same_files(src, store.fetch("round-000001", sha256=True))
    assert store.names() == ["round-000001"]
    assert sorted(p.name for p in store.root.iterdir()) == ["round-000001"]
    # a damaged file is caught
    (store.path("round-000001") / "trainer_state.pt").write_bytes(b"short")
    with pytest.raises(CheckpointIntegrityError, match="trainer_state.pt"):
        store.fetch("round-000001")
    with pytest.raises(FileNotFoundError):
        store.publish(tmp_path / "nope", "round-000009")
