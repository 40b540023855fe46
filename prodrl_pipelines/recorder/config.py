"""The recorder's configuration (``prodrl record``'s flags), checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prodrl_pipelines.storage.blobstore import LocalBlobStore

TOKEN_ENV = "PRODRL_RECORDER_TOKEN"
UPSTREAM_KEY_ENV = "PRODRL_UPSTREAM_API_KEY"


@dataclass
class RecorderConfig:
    upstream: str
    store_dir: str  # local store directory ("" when the store is on S3)
    token: str = ""  # one bearer token (tenant ``default``), or ``tokens_file``
    wal_dir: str | None = None  # default: <store_dir>/_recorder/wal (required with an S3 store)
    top_logprobs: int = 20  # K recorded per generated position
    upstream_max_logprobs: int = 20  # the upstream's --max-logprobs
    policy_version: str | None = None
    tokenizer_dir: str | None = None
    upstream_api_key: str | None = None
    flush_rows: int = 1024
    flush_interval_s: float = 2.0
    upstream_timeout_s: float = 120.0
    # Idle upstream connections are reused for at most this long: below the upstream's own keep-alive
    # timeout (vLLM and uvicorn: 5 s), else a reused connection can be closed under a request.
    upstream_keepalive_s: float = 3.0
    max_body_bytes: int = 8 << 20  # client bodies past this are a 413, before they are parsed
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    default_top_k: int = 0
    s3_bucket: str = ""  # set: the store's tables go to s3://<s3_bucket>/<s3_prefix>/ (the WAL stays local)
    s3_prefix: str = ""
    s3_endpoint_url: str = ""  # empty: AWS; else an S3-compatible server (MinIO, moto, ...)
    s3_region: str = ""
    record_extra_draw: bool = False  # ask the upstream for the extra draw a' ~ mu (``extra_token_ids``)
    # the deployment's endpoint file (deploy_targets.base.EndpointFile): upstream URL, served model name
    # and policy version re-read whenever it changes, instead of a fixed ``upstream``
    follow: str | None = None
    tokens_file: str | None = None  # bearer tokens -> tenants (``tenants``), re-read when it changes
    # PostgreSQL shared by a fleet's recorders: call indices and attempts (recorder.indexer); empty: in memory
    coordination_url: str = ""
    # "extend": a session's chat calls are rendered here and sent as extensions of the previous call's
    # tokens (recorder.chat_extend); reply_parser: how those replies are read (the deployment's)
    chat_history: str = "rerender"
    reply_parser: str = "none"
    # a session's next call goes to the replica that served its last one (its prefix is cached there)
    # while that replica is healthy and not overloaded; False: every call to the least loaded replica
    session_affinity: bool = True
    # one JSON line per API request (recorder.request_log): a file, "-" for standard output, None: off
    request_log: str | None = None
    # per-request histograms and the in-flight gauge on /metrics (False: counters and gauges read at
    # scrape time only, no work per request)
    request_metrics: bool = True

    def __post_init__(self) -> None:
        from prodrl_pipelines.engines.reply_parsers import TOOL_FORMATS

        if self.chat_history not in ("rerender", "extend"):
            raise ValueError(f"chat_history must be 'rerender' or 'extend', got {self.chat_history!r}")
        if self.reply_parser != "none" and self.reply_parser not in TOOL_FORMATS:
            raise ValueError(f"reply_parser must be 'none' or one of {sorted(TOOL_FORMATS)}, got {self.reply_parser!r}")
        if bool(self.upstream) == bool(self.follow):
            raise ValueError("the recorder needs exactly one upstream: a URL (--upstream) or the deployment's "
                             "endpoint file to follow (--follow)")
        if bool(self.token) == bool(self.tokens_file):
            raise ValueError(f"the recorder needs exactly one source of bearer tokens: {TOKEN_ENV} (one tenant) "
                             "or --tokens-file (tenants)")
        if bool(self.store_dir) == bool(self.s3_bucket):
            raise ValueError("the recorder needs exactly one trajectory store: a local directory (--store) "
                             "or an S3 bucket (--s3-bucket)")
        if self.s3_bucket and not self.wal_dir:
            raise ValueError("with an S3 trajectory store the write-ahead log needs a local --wal-dir")
        if self.top_logprobs < 1 or self.top_logprobs > self.upstream_max_logprobs:
            raise ValueError(f"top_logprobs must be in [1, upstream_max_logprobs={self.upstream_max_logprobs}], "
                             f"got {self.top_logprobs}")
        self.upstream = self.upstream.rstrip("/")
        if self.upstream.endswith("/v1"):
            self.upstream = self.upstream[: -len("/v1")]

    def blob_store(self):
        """The ``BlobStore`` the Parquet parts go to (local directory or S3)."""
        if self.s3_bucket:
            from prodrl_pipelines.storage.s3 import S3BlobStore

            return S3BlobStore(self.s3_bucket, self.s3_prefix, endpoint_url=self.s3_endpoint_url or None,
                               region=self.s3_region or None)
        return LocalBlobStore(self.store_dir)

    @property
    def wal_path(self) -> str:
        return self.wal_dir or str(Path(self.store_dir) / "_recorder" / "wal")
