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

import os
import sys
import threading
import time
import traceback
from pathlib import Path

from prodrl_pipelines.stack.processes import ManagedProcess

TOKEN_ENV = "PRODRL_RECORDER_TOKEN"


class LiveServing:
    def __init__(self, *, env: dict, home: Path, serve_port: int, record_port: int, token: str,
                 s3: dict, settings: dict, poll_s: float = 2.0, log=print) -> None:
        self.env = {**env, TOKEN_ENV: token}
        self.env.pop("VLLM_API_KEY", None)
        self.home, self.serve_port, self.record_port, self.token = home, serve_port, record_port, token
        self.s3, self.settings, self.poll_s, self.log = s3, settings, poll_s, log
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
            from prodrl_pipelines.resources.settings import make_resources, services

            res = make_resources({**self.settings, "home": str(self.home)}, s3=self.s3)
            self._svc = services(res["settings"], res["store"])
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
        if svc.registry.live() is None:
            return
        if self.serve is not None and self.serve.alive() and self.version == svc.registry.live().policy_version:
            if self.record is None or not self.record.alive():
                self._start_recorder(svc)
            return
        live = svc.live()  # fetches the export from the store if this machine lacks it
        t0 = time.monotonic()
        if self.serve is not None:
            self.serve.stop()
        k = svc.settings.deploy.num_top_logprobs
        exe = [sys.executable, "-m", "prodrl_pipelines.cli"]
        self.serve = ManagedProcess("prodrl serve", exe + [
            "serve", str(live.export_dir), "--port", str(self.serve_port),
            "--served-model-name", live.policy_version, "--max-logprobs", str(max(k, 20)),
            "--generation-config", "vllm", "--threads", "1", "--max-batch-size", "256"],
            self.env, self.home / "logs" / "serve.log")
        self.serve.wait_http(f"{self.serve_url}/health", timeout_s=180, cancel=self._stop)
        self.log(f"deployment: {live.policy_version} serving at {self.serve_url} "
                 f"(switch {time.monotonic() - t0:.1f}s)")
        self.version, self._export_dir = live.policy_version, str(live.export_dir)
        if self.record is None or not self.record.alive():
            self._start_recorder(svc)

    def _start_recorder(self, svc) -> None:
        k = svc.settings.deploy.num_top_logprobs
        exe = [sys.executable, "-m", "prodrl_pipelines.cli"]
        store = ["--s3-bucket", self.s3["s3_bucket"], "--s3-prefix", self.s3["s3_prefix"],
                 "--s3-endpoint-url", self.s3["s3_endpoint_url"], "--s3-region", self.s3["s3_region"],
                 "--wal-dir", str(self.home / "recorder_wal")]
        self.record = ManagedProcess("prodrl record", exe + [
            "record", "--upstream", self.serve_url, *store, "--port", str(self.record_port),
            "--tokenizer", self._export_dir, "--top-logprobs", str(k), "--upstream-max-logprobs", str(max(k, 20)),
            *(["--record-extra-draw"] if svc.settings.deploy.record_extra_draw else [])],
            self.env, self.home / "logs" / "record.log")
        self.record.wait_http(f"{self.record_url}/health", timeout_s=120,
                              headers={"Authorization": f"Bearer {self.token}"}, cancel=self._stop)
        self.log(f"recorder: {self.record_url}/v1 in front of {self.serve_url}")

    def stop(self) -> None:
        """Stop polling, then the recorder (it flushes its WAL to the store) and the server."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for p in self.processes():
            p.stop(timeout_s=60)
