"""The stack's deployment: ``prodrl serve`` on the live export, ``prodrl record`` in front of it.

A thread of ``prodrl up`` polls the deployment registry (``deploy/live.json`` in the store). When a
policy is live it starts ``prodrl serve <export> --served-model-name <policy version>`` on the
deployment port and, the first time, ``prodrl record --upstream <deployment>`` on the recorder port;
when the live version changes (a round deployed a candidate) it restarts the server on the same
port with the new export. The recorder stays up (its URL never changes) and tags each call with the
served model name of the answer, i.e. the version that really produced it. Between the old server
stopping and the new one answering, calls get a 502 from the recorder (a few seconds); nothing is
recorded for them.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path

from prodrl_pipelines.config.environment import RECORDER_TOKEN
from prodrl_pipelines.deploy_targets.processes import ManagedProcess



def recorder_store_args(svc, wal_dir: Path) -> list[str]:
    """The ``prodrl record`` flags naming ``svc``'s trajectory store: ``--store DIR`` for a local
    store, the ``--s3-*`` flags (and a local ``--wal-dir``) for an S3 one."""
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.storage.s3 import S3BlobStore

    blobs = svc.blobs
    if isinstance(blobs, LocalBlobStore):
        return ["--store", str(blobs.root)]
    if isinstance(blobs, S3BlobStore):
        return ["--s3-bucket", blobs.bucket, "--s3-prefix", blobs.prefix,
                "--s3-endpoint-url", blobs.endpoint_url or "", "--s3-region", blobs.region or "",
                "--wal-dir", str(wal_dir)]
    raise RuntimeError(f"`prodrl record` writes to a local or S3 trajectory store; got {blobs!r}")


class LiveServing:
    """``services``: a callable returning the round ``Services`` (their registry says what is live)."""

    def __init__(self, *, env: dict, home: Path, serve_port: int, record_port: int, token: str,
                 services, poll_s: float = 2.0, log=print) -> None:
        self.env = {**env, RECORDER_TOKEN: token}
        self.env.pop("VLLM_API_KEY", None)
        self.home, self.serve_port, self.record_port, self.token = home, serve_port, record_port, token
        self._services_factory, self.poll_s, self.log = services, poll_s, log
        self.serve: ManagedProcess | None = None
        self.record: ManagedProcess | None = None
        self.version: str | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._svc = None

    @property
    def serve_url(self) -> str:
        return f"http://127.0.0.1:{self.serve_port}"

    @property
    def record_url(self) -> str:
        return f"http://127.0.0.1:{self.record_port}"

    def processes(self) -> list[ManagedProcess]:
        return [p for p in (self.record, self.serve) if p is not None]

    def _services(self):
        if self._svc is None:
            self._svc = self._services_factory()
        return self._svc

    def start(self) -> "LiveServing":
        self._thread = threading.Thread(target=self._run, name="prodrl-live-serving", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
                self.error = None
            except Exception as exc:  # noqa: BLE001 - keep polling; the next tick may succeed
                if self._stop.is_set():
                    break
                msg = f"{type(exc).__name__}: {exc}"
                if msg != self.error:
                    self.log(f"deployment: {msg}")
                    traceback.print_exc(file=sys.stderr)
                self.error = msg
            self._stop.wait(self.poll_s)

    def sync(self) -> None:
        """One poll: make the served version the live one."""
        svc = self._services()
        if svc.ledger.live() is None:
            return
        if self.serve is not None and self.serve.alive() and self.version == svc.ledger.live().policy_version:
            if self.record is None or not self.record.alive():
                self._start_recorder(svc)
            return
        live = svc.live()  # fetches the export from the store if this machine lacks it
        t0 = time.monotonic()
        if self.serve is not None:
            self.serve.stop()
        k = svc.settings.deploy.num_top_logprobs
        exe = [sys.executable, "-m", "prodrl_pipelines.cli"]
        self.serve = None
        serve = ManagedProcess("prodrl serve", exe + [
            "serve", str(live.export_dir), "--port", str(self.serve_port),
            "--served-model-name", live.policy_version, "--max-logprobs", str(max(k, 20)),
            "--generation-config", "vllm", "--threads", "1", "--max-batch-size", "256"],
            self.env, self.home / "logs" / "serve.log")
        try:
            serve.wait_http(f"{self.serve_url}/health", timeout_s=180, cancel=self._stop)
        except BaseException:
            serve.stop()
            raise
        self.serve = serve
        self.log(f"deployment: {live.policy_version} serving at {self.serve_url} "
                 f"(switch {time.monotonic() - t0:.1f}s)")
        self.version, self._export_dir = live.policy_version, str(live.export_dir)
        if self.record is None or not self.record.alive():
            self._start_recorder(svc)

    def _start_recorder(self, svc) -> None:
        k = svc.settings.deploy.num_top_logprobs
        exe = [sys.executable, "-m", "prodrl_pipelines.cli"]
        store = recorder_store_args(svc, self.home / "recorder_wal")
        record = ManagedProcess("prodrl record", exe + [
            "record", "--upstream", self.serve_url, *store, "--port", str(self.record_port),
            "--tokenizer", self._export_dir, "--top-logprobs", str(k), "--upstream-max-logprobs", str(max(k, 20)),
            *(["--record-extra-draw"] if svc.settings.deploy.record_extra_draw else [])],
            self.env, self.home / "logs" / "record.log")
        try:
            record.wait_http(f"{self.record_url}/health", timeout_s=120,
                             headers={"Authorization": f"Bearer {self.token}"}, cancel=self._stop)
        except BaseException:
            record.stop()
            raise
        self.record = record  # listed (stack.json) once it answers
        self.log(f"recorder: {self.record_url}/v1 in front of {self.serve_url}")

    def stop(self) -> None:
        """Stop polling, then the recorder (it flushes its WAL to the store) and the server."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for p in self.processes():
            p.stop(timeout_s=60)
