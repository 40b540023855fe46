"""``prodrl record``: the command line of the recording proxy."""

from __future__ import annotations

import argparse
import ast
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from prodrl_pipelines.engines.server import KEEP_ALIVE_S
from prodrl_pipelines.config import environment
from prodrl_pipelines.config.environment import RECORDER_TOKEN

if TYPE_CHECKING:
    from prodrl_pipelines.recorder.service import RecorderConfig


def _service_doc() -> str:
    """The recorder's documentation (``recorder/service.py``'s docstring) for ``--help``, read from
    its source: every ``prodrl`` command builds this parser, and importing the recorder (pyarrow, the
    store, the WAL) would cost each of them, ``prodrl serve`` included, ~0.4 s of CPU."""
    src = Path(__file__).resolve().parents[1] / "recorder" / "service.py"
    return ast.get_docstring(ast.parse(src.read_text())) or ""


# ----------------------------------------------------------------------------- CLI


def add_record_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("record", help="recording proxy in front of a vLLM-compatible server",
                       description=_service_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    up = r.add_mutually_exclusive_group(required=True)
    up.add_argument("--upstream", default="", help="base URL of the vLLM-compatible server")
    up.add_argument("--follow", default=None, help="the deployment's endpoint record: its file (<home>/deployment/endpoint.json), or "
                    "URL#NAME for one in PostgreSQL (deploy.endpoint_store, deploy.endpoint_name): upstream URL, "
                    "served model name and policy version, re-read when a deploy changes it")
    r.add_argument("--store", default="", help="trajectory store directory (or --s3-bucket)")
    r.add_argument("--s3-bucket", default="", help="trajectory store on S3: the bucket (instead of --store; "
                   "needs --wal-dir; credentials from the boto3 default chain)")
    r.add_argument("--s3-prefix", default="", help="key prefix of the S3 trajectory store")
    r.add_argument("--s3-endpoint-url", default="", help="S3-compatible endpoint (MinIO, moto, ...); default AWS")
    r.add_argument("--s3-region", default="", help="S3 region (default: the boto3 default, else us-east-1)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8100)
    r.add_argument("--wal-dir", default=None, help="write-ahead log directory, on local disk "
                   "(default <store>/_recorder/wal; required with --s3-bucket)")
    r.add_argument("--coordination-url", default="",
                   help="PostgreSQL URL shared by every recorder of a fleet: call indices, retries and feedback "
                   "work whichever replica a request reaches (default: this process's memory)")
    r.add_argument("--policy-version", default=None, help="policy version of the calls (default: upstream model)")
    r.add_argument("--tokenizer", default=None, help="the served model's tokenizer dir (token strings)")
    r.add_argument("--top-logprobs", type=int, default=20, help="K: head size recorded per position")
    r.add_argument("--upstream-max-logprobs", type=int, default=20, help="the upstream's --max-logprobs")
    r.add_argument("--flush-rows", type=int, default=1024, help="flush to Parquet after this many records")
    r.add_argument("--max-body-bytes", type=int, default=8 << 20, help="refuse larger client bodies with a 413")
    r.add_argument("--flush-interval", type=float, default=2.0, help="... or after this many seconds")
    r.add_argument("--upstream-timeout", type=float, default=120.0, help="seconds before a 504")
    r.add_argument("--upstream-keepalive", type=float, default=3.0,
                   help="reuse an idle upstream connection for at most this many seconds (keep it below the "
                        "upstream's keep-alive timeout: 5 s for vLLM)")
    r.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                   help="seconds an idle client connection stays open (above the clients' reuse window)")
    r.add_argument("--record-extra-draw", action="store_true",
                   help="also ask the upstream for the extra draw a' ~ mu (prodrl serve's `extra_draw` extension) "
                        "and record it as extra_token_ids (null and counted when the upstream has none, e.g. vLLM)")
    for name, typ, default in (("temperature", float, 1.0), ("top-p", float, 1.0), ("top-k", int, 0)):
        r.add_argument(f"--default-{name}", type=typ, default=default,
                       help=f"{name} asked of the upstream when a client leaves it out (default {default}; "
                            "set the upstream's own defaults here, e.g. the model's generation_config.json under "
                            "vLLM's --generation-config auto, so such a client samples as it would directly)")
    r.add_argument("--tokens-file", default=None, help="bearer tokens of tenants (JSON, re-read when it changes; "
                   "see prodrl_pipelines/recorder/tenants.py) instead of one $" + RECORDER_TOKEN)
    r.add_argument("--chat-history", choices=("rerender", "extend"), default="rerender",
                   help="extend: a session's chat calls are rendered here (the model's chat template, --tokenizer "
                        "or the upstream's) and sent as extensions of the previous call's tokens, so an episode "
                        "trains as one sequence where the template would re-render history (docs/agents.md)")
    r.add_argument("--reply-parser", default="none",
                   help="with --chat-history extend: how replies are parsed into reasoning and tool calls "
                        "(the deployment's --reply-parser: none or qwen3)")
    r.add_argument("--no-session-affinity", dest="session_affinity", action="store_false",
                   help="send every call to the least loaded replica of its version, instead of a session's "
                        "calls to the replica that served its last one (whose prefix cache holds its history)")
    r.add_argument("--request-log", default=None, metavar="PATH",
                   help="one JSON line per API request (route, tenant, version, replica, status, latencies, token "
                        "counts, trajectory id; never prompt or output text) appended to PATH; - for standard output")
    r.add_argument("--no-request-metrics", dest="request_metrics", action="store_false",
                   help="no per-request histograms or in-flight gauge on /metrics (its counters and gauges stay)")
    r.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: the server's own log lines as JSON objects too (the request log's shape)")
    r.add_argument("--log-level", default="warning")
    r.set_defaults(fn=cmd_record)
    return r


def recorder_config(args, token: str | None) -> RecorderConfig:
    """The recorder's configuration from ``prodrl record``'s arguments and the environment."""
    from prodrl_pipelines.recorder.service import RecorderConfig

    return RecorderConfig(
        upstream=args.upstream, store_dir=args.store, token=token, wal_dir=args.wal_dir,
        top_logprobs=args.top_logprobs, upstream_max_logprobs=args.upstream_max_logprobs,
        policy_version=args.policy_version, tokenizer_dir=args.tokenizer,
        # following a deployment's record, its servers want the deployment's key unless told otherwise
        upstream_api_key=environment.upstream_api_key() or (environment.deploy_api_key() if args.follow else None),
        flush_rows=args.flush_rows, max_body_bytes=args.max_body_bytes,
        flush_interval_s=args.flush_interval, upstream_timeout_s=args.upstream_timeout,
        s3_bucket=args.s3_bucket, s3_prefix=args.s3_prefix, s3_endpoint_url=args.s3_endpoint_url,
        s3_region=args.s3_region, record_extra_draw=args.record_extra_draw,
        upstream_keepalive_s=args.upstream_keepalive, follow=args.follow, tokens_file=args.tokens_file,
        default_temperature=args.default_temperature, default_top_p=args.default_top_p,
        default_top_k=args.default_top_k, coordination_url=args.coordination_url,
        chat_history=args.chat_history, reply_parser=args.reply_parser,
        session_affinity=args.session_affinity, request_log=args.request_log,
        request_metrics=args.request_metrics,
    )


def cmd_record(args) -> int:
    import uvicorn

    from prodrl_pipelines.observability.json_logs import log_config_kwargs
    from prodrl_pipelines.recorder.http import build_recorder_app

    token = environment.recorder_token()
    if not token and not args.tokens_file:
        print(f"prodrl record: set {RECORDER_TOKEN} to the bearer token clients must send, or give --tokens-file",
              file=sys.stderr)
        return 2
    try:
        cfg = recorder_config(args, token)
        app = build_recorder_app(cfg)  # a bad tokens file fails here, before the server starts
    except ValueError as e:
        print(f"prodrl record: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=10,
                                           timeout_keep_alive=args.timeout_keep_alive,
                                           **log_config_kwargs(args.log_format, "recorder")))
    stopped_by = serve_until_signal(server)
    if not server.started:
        return 3  # uvicorn's startup failure (it logged why)
    left = app.state.recorder.unflushed_segments
    if left != 0:  # nothing acknowledged is lost: the write-ahead log is replayed at the next start
        why = "its shutdown failed (see above)" if left is None else f"{left} write-ahead log segment(s) not flushed"
        print(f"prodrl record: stopped ({', '.join(signal.Signals(s).name for s in stopped_by) or 'no signal'}) "
              f"before everything recorded reached the store: {why}; they are replayed at the next start with the "
              "same write-ahead log directory", file=sys.stderr)
        return 1
    return 0


def serve_until_signal(server) -> list[int]:
    """Run a ``uvicorn.Server`` until SIGTERM or SIGINT and its graceful shutdown (the app's lifespan
    ends: the recorder flushes); the signals that stopped it.

    uvicorn re-raises a signal it stopped on once it is done, with the handlers it found installed,
    so that under the default handlers the process dies by SIGTERM (exit status -15, 143 in a shell)
    after a clean shutdown. The handlers installed here note the signal instead (and stop a server
    that is still starting), so a clean shutdown is a normal return and its exit status says whether
    everything was flushed."""
    got: list[int] = []

    def note(sig, frame) -> None:
        got.append(sig)
        server.should_exit = True

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return got
