"""``BlobStore`` on S3 (or any S3-compatible endpoint) through boto3, with the local store's key layout.

Key ``a/b/c`` of a store with prefix ``p`` is the object ``s3://<bucket>/p/a/b/c`` (the local store
keeps it as the file ``<root>/a/b/c``), so the trajectory store, round documents, checkpoints and
exports have the same layout on both.

* Atomic writes: an S3 PUT (and a completed multipart upload) is atomic; readers see the whole old
  object or the whole new one. Large payloads (``>= multipart_threshold``) go through boto3's transfer
  manager, which splits them into parts and aborts the upload on failure.
* Retries: every request goes through botocore's retry handler in ``standard`` (default) or
  ``adaptive`` mode (exponential backoff with jitter on 5xx, throttling, timeouts and connection
  errors). A response body that breaks off while streaming is re-read the same number of times.
  When the attempts are used up the store raises ``S3BlobStoreError``, naming the operation, the
  bucket, the key and the number of attempts.
* Credentials come from the boto3 default chain (environment ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, shared config and credential files and profile,
  container or instance roles); none are taken as arguments.
* ``list`` follows the continuation tokens of ``ListObjectsV2`` page by page (``list_page_size``
  keys per request).
"""

from __future__ import annotations

import io
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from prodrl_pipelines.storage.blobstore import BlobNotFoundError, BlobStore, validate_key

T = TypeVar("T")

RETRY_MODES = ("standard", "adaptive")
DEFAULT_MAX_ATTEMPTS = 5
_MiB = 1024 * 1024
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}


class S3BlobStoreError(RuntimeError):
    """An S3 request failed for good (after retries, or with a non-retryable error).

    The message names the operation, the bucket and the full object key (or prefix).
    """

    def __init__(self, operation: str, bucket: str, key: str, detail: str, attempts: int | None = None) -> None:
        self.operation = operation
        self.bucket = bucket
        self.key = key
        self.attempts = attempts
        tries = f" after {attempts} attempt{'s' if attempts != 1 else ''}" if attempts else ""
        super().__init__(f"S3 {operation} failed for bucket {bucket!r}, key {key!r}{tries}: {detail}")


class S3BlobStore(BlobStore):
    """Objects under ``s3://<bucket>/<prefix>/``; see the module docstring for guarantees.

    ``endpoint_url`` selects an S3-compatible server (MinIO, moto, Ceph, R2...); path-style addressing
    is used there unless ``addressing_style`` says otherwise. ``region`` defaults to the boto3
    session's region, else ``us-east-1``. ``client`` injects a ready boto3 S3 client (its own retry
    configuration then applies).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_mode: str = "standard",
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        list_page_size: int = 1000,
        multipart_threshold: int = 64 * _MiB,
        multipart_chunksize: int = 16 * _MiB,
        max_concurrency: int = 4,
        addressing_style: str | None = None,
        client: Any | None = None,
    ) -> None:
        if not bucket or not isinstance(bucket, str):
            raise ValueError(f"S3 bucket must be a non-empty string, got {bucket!r}")
        if retry_mode not in RETRY_MODES:
            raise ValueError(f"retry_mode must be one of {RETRY_MODES}, got {retry_mode!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not 1 <= list_page_size <= 1000:
            raise ValueError(f"list_page_size must be in 1..1000 (S3's maximum), got {list_page_size}")
        if multipart_chunksize < 5 * _MiB:
            raise ValueError("multipart_chunksize must be >= 5 MiB (S3's minimum part size)")
        prefix = (prefix or "").strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url or None
        self.region = region or None
        self.max_attempts = int(max_attempts)
        self.retry_mode = retry_mode
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.list_page_size = int(list_page_size)
        self.multipart_threshold = int(multipart_threshold)
        self.multipart_chunksize = int(multipart_chunksize)
        self.max_concurrency = int(max_concurrency)
        self.addressing_style = addressing_style or ("path" if self.endpoint_url else "auto")
        self._client = client
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        ep = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3BlobStore({self.bucket!r}, {self.prefix!r}{ep})"

    def __getstate__(self) -> dict:  # picklable: the client is rebuilt on first use
        state = self.__dict__.copy()
        state["_client"] = None
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------ plumbing

    @property
    def client(self):
        """The boto3 S3 client (created on first use; thread-safe)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    import boto3
                    from botocore.config import Config

                    session = boto3.session.Session()
                    cfg = Config(
                        retries={"total_max_attempts": self.max_attempts, "mode": self.retry_mode},  # incl. the first
                        connect_timeout=self.connect_timeout,
                        read_timeout=self.read_timeout,
                        s3={"addressing_style": self.addressing_style},
                        max_pool_connections=max(10, self.max_concurrency * 2),
                    )
                    self._client = session.client(
                        "s3", endpoint_url=self.endpoint_url,
                        region_name=self.region or session.region_name or "us-east-1", config=cfg,
                    )
        return self._client

    def _transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold, multipart_chunksize=self.multipart_chunksize,
            max_concurrency=self.max_concurrency, use_threads=self.max_concurrency > 1,
        )

    def full_key(self, key: str) -> str:
        """The object key in the bucket for store key ``key``."""
        key = validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _full_prefix(self, prefix: str) -> str:
        if self.prefix:
            return f"{self.prefix}/{prefix}"
        return prefix

    def _call(self, operation: str, key: str, fn: Callable[[], T], *, missing: Callable[[], T] | None = None) -> T:
        """Run one boto3 call; a missing object goes to ``missing`` (if given), anything else that
        fails for good becomes ``S3BlobStoreError`` naming bucket and key."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as e:
            err = e.response.get("Error", {}) or {}
            code = str(err.get("Code", ""))
            if missing is not None and code in _NOT_FOUND:
                return missing()
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            attempts = _attempts(e.response)
            detail = f"{code or 'error'} (HTTP {status}): {err.get('Message') or e}"
            raise S3BlobStoreError(operation, self.bucket, key, detail, attempts) from e
        except (BotoCoreError, Boto3Error) as e:
            # Connection errors and timeouts reach here once botocore has spent its attempts.
            raise S3BlobStoreError(operation, self.bucket, key, f"{type(e).__name__}: {e}", self.max_attempts) from e

    def _with_stream_retries(self, operation: str, key: str, fn: Callable[[], T]) -> T:
        """Retry ``fn`` when a response body breaks off while it is read (botocore retries requests,
        not the streaming of their bodies)."""
        from botocore.exceptions import (ConnectionClosedError, IncompleteReadError, ReadTimeoutError,
                                         ResponseStreamingError)

        transient = (IncompleteReadError, ReadTimeoutError, ResponseStreamingError, ConnectionClosedError,
                     ConnectionError)
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except transient as e:
                if attempt == self.max_attempts:
                    raise S3BlobStoreError(operation, self.bucket, key, f"{type(e).__name__}: {e}", attempt) from e
                time.sleep(random.random() * min(0.05 * 2 ** (attempt - 1), 5.0))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------ BlobStore

    def put_bytes(self, key: str, data: bytes) -> None:
        fk = self.full_key(key)
        data = bytes(data)
        if len(data) >= self.multipart_threshold:
            self._call("put (multipart)", fk, lambda: self.client.upload_fileobj(
                io.BytesIO(data), self.bucket, fk, Config=self._transfer_config()))
        else:
            self._call("put", fk, lambda: self.client.put_object(Bucket=self.bucket, Key=fk, Body=data))

    def get_bytes(self, key: str) -> bytes:
        fk = self.full_key(key)

        def missing():
            raise BlobNotFoundError(key, f"s3://{self.bucket}/{self.prefix}")

        def once() -> bytes:
            resp = self._call("get", fk, lambda: self.client.get_object(Bucket=self.bucket, Key=fk), missing=missing)
            return resp["Body"].read()

        return self._with_stream_retries("get", fk, once)

    def exists(self, key: str) -> bool:
        fk = self.full_key(key)
        return self._call("head", fk, lambda: self.client.head_object(Bucket=self.bucket, Key=fk) is not None,
                          missing=lambda: False)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[str]:
        full = self._full_prefix(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        # StartAfter makes S3 skip the keys at or before it: a tail of a log costs what is new, not its history
        after = {"StartAfter": self.full_key(start_after)} if start_after else {}

        def run() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full, PaginationConfig={"PageSize": self.list_page_size}, **after)
            keys: list[str] = []
            for page in pages:
                for obj in page.get("Contents", []) or []:
                    k = obj["Key"][strip:]
                    if k.startswith(prefix) and k and not k.endswith("/"):  # skip "folder" marker objects
                        keys.append(k)
            return keys

        keys = self._call("list", full or "<bucket root>", run)
        keys.sort()
        return keys

    def delete(self, key: str, *, missing_ok: bool = False) -> None:
        fk = self.full_key(key)
        if not missing_ok and not self.exists(key):  # S3's DELETE succeeds on a missing key
            raise BlobNotFoundError(key, f"s3://{self.bucket}/{self.prefix}")
        self._call("delete", fk, lambda: self.client.delete_object(Bucket=self.bucket, Key=fk))

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.full_key(key)}"

    # ------------------------------------------------------------------------------ files (large objects)

    def put_file(self, key: str, path: Path | str) -> None:
        """Upload a local file (multipart above ``multipart_threshold``, without reading it into memory)."""
        fk = self.full_key(key)
        self._call("put (file)", fk, lambda: self.client.upload_file(
            str(path), self.bucket, fk, Config=self._transfer_config()))

    def get_file(self, key: str, path: Path | str) -> None:
        """Download an object to a local file (ranged parallel GETs for large objects)."""
        fk = self.full_key(key)

        def missing():
            raise BlobNotFoundError(key, f"s3://{self.bucket}/{self.prefix}")

        # download_file HEADs first (a missing key is a 404 there) and re-reads broken-off bodies itself.
        self._call("get (file)", fk, lambda: self.client.download_file(
            self.bucket, fk, str(path), Config=self._transfer_config()), missing=missing)

    def create_bucket(self, *, exist_ok: bool = True) -> None:
        """Create the bucket (for tests and the lab; production buckets are provisioned elsewhere)."""
        from botocore.exceptions import ClientError

        try:
            kw: dict[str, Any] = {"Bucket": self.bucket}
            region = self.client.meta.region_name
            if region and region != "us-east-1":
                kw["CreateBucketConfiguration"] = {"LocationConstraint": region}
            self.client.create_bucket(**kw)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if not (exist_ok and code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists")):
                raise S3BlobStoreError("create bucket", self.bucket, "", str(e), _attempts(e.response)) from e


def _attempts(response: dict) -> int | None:
    meta = response.get("ResponseMetadata", {}) or {}
    if "RetryAttempts" in meta:
        return int(meta["RetryAttempts"]) + 1
    return None
