"""Debian's Prometheus and promtool for the tests (``make prometheus`` unpacks them into a cache:
scripts/build_prometheus.sh), and a Prometheus server on loopback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from prodrl_pipelines.deploy_targets.processes import pick_port
from tests.helpers import wait_healthy

DEFAULT_DIR = Path.home() / ".cache" / "prodrl" / "prometheus-2.42.0"


def prometheus_bin(name: str = "prometheus") -> str:
    """``prometheus`` or ``promtool``, or skip (fail under CI) with the reason."""
    path = Path(os.environ.get("PRODRL_PROMETHEUS_DIR") or DEFAULT_DIR) / "usr" / "bin" / name
    if not path.is_file():
        msg = f"no {name} at {path}: `make prometheus` unpacks Debian's package there"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return str(path)


class PrometheusServer:
    """``prometheus`` with ``config`` on a free loopback port, its data under ``workdir``; stopped by pid."""

    def __init__(self, config: Path, workdir: Path) -> None:
        self.port = pick_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self._fh = open(self.log, "ab")
        self.proc = subprocess.Popen([prometheus_bin(), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self._fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.proc, self.url + "/-/ready", timeout_s=120, what="prometheus", log=self.log)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()

    kill = stop  # what a test's cleanup calls on whatever it started
