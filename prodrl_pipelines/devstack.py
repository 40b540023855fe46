"""A local production-shaped stack: S3-compatible endpoint, MLflow server, Dagster webserver + daemon.

    prodrl up --home runs/stack          (make up)

Everything runs on loopback: `moto_server` as the S3 endpoint, an MLflow tracking server with its
backend on PostgreSQL and artifacts on S3, and `dagster-webserver` + `dagster-daemon` on the
PostgreSQL instance of this repo's dagster.yaml. The daemon runs the data-volume sensor, so rounds
start by themselves as rewarded traffic arrives. Every process is started with its own process
group and stopped (TERM, then KILL) when the stack closes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prodrl_pipelines.preflight import PreflightError, check_postgres, libpq_dsn

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; last log lines:\n{_tail(log)}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout_s:.0f}s; log:\n{_tail(log)}")


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _with_schema(url: str, schema: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


@dataclass
class Stack:
    home: Path
    pg_url: str  # postgresql+psycopg2://... (the Dagster instance and the MLflow backend)
    settings: dict = field(default_factory=dict)  # ProdRLSettings fields
    schema: str = ""  # optional: put Dagster and MLflow in PostgreSQL schemas of their own
    sensor_interval_s: int = 30
    bucket: str = "prodrl"
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def env(self) -> dict:
        return self._env

    def start(self) -> "Stack":
        check_postgres(self.pg_url, "DAGSTER_PG_URL")  # fail before anything starts
        self.home = self.home.resolve()
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        dh = self.home / "dagster_home"
        dh.mkdir(exist_ok=True)
        shutil.copy(REPO / "dagster.yaml", dh / "dagster.yaml")
        self.ports = {"s3": free_port(), "mlflow": free_port(), "dagster": free_port()}
        dagster_pg = _with_schema(self.pg_url, f"{self.schema}_dagster") if self.schema else self.pg_url
        mlflow_pg = _with_schema(self.pg_url, f"{self.schema}_mlflow") if self.schema else self.pg_url
        if self.schema:
            self._create_schemas()
        s3 = f"http://127.0.0.1:{self.ports['s3']}"
        self._env = {
            **os.environ,
            "DAGSTER_HOME": str(dh), "DAGSTER_PG_URL": dagster_pg,
            "PRODRL_HOME": str(self.home),
            "PRODRL_SETTINGS_JSON": json.dumps({**self.settings, "home": str(self.home)}),
            "PRODRL_SENSOR_INTERVAL_S": str(self.sensor_interval_s),
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{self.ports['mlflow']}",
            "MLFLOW_S3_ENDPOINT_URL": s3, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "PYTHONUNBUFFERED": "1",
            # trajectories, round documents and published exports on the S3 endpoint
            "PRODRL_S3_BUCKET": self.bucket, "PRODRL_S3_PREFIX": "prodrl", "PRODRL_S3_ENDPOINT_URL": s3,
            "PRODRL_S3_REGION": "us-east-1",
        }
        self._spawn("s3", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.ports["s3"])])
        _wait_http(s3, "moto_server", self.procs[-1][1], self.home / "logs" / "s3.log")
        import boto3

        boto3.client("s3", endpoint_url=s3, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=self.bucket)
        self._spawn("mlflow", [str(BIN / "mlflow"), "server", "--backend-store-uri", mlflow_pg,
                               "--artifacts-destination", f"s3://{self.bucket}/mlflow", "--host", "127.0.0.1",
                               "--port", str(self.ports["mlflow"]), "--workers", "1"])
        _wait_http(f"http://127.0.0.1:{self.ports['mlflow']}/health", "mlflow server", self.procs[-1][1],
                   self.home / "logs" / "mlflow.log")
        self._spawn("webserver", [str(BIN / "dagster-webserver"), "-m", "prodrl_pipelines.definitions",
                                  "-h", "127.0.0.1", "-p", str(self.ports["dagster"])])
        _wait_http(f"http://127.0.0.1:{self.ports['dagster']}/server_info", "dagster-webserver",
                   self.procs[-1][1], self.home / "logs" / "webserver.log")
        self._spawn("daemon", [str(BIN / "dagster-daemon"), "run", "-m", "prodrl_pipelines.definitions"])
        return self

    def _each_schema(self, sql: str) -> None:
        """Run ``sql`` (with ``{s}`` for the schema name) for the Dagster and the MLflow schema."""
        import psycopg2

        conn = psycopg2.connect(libpq_dsn(self.pg_url))
        conn.autocommit = True
        with conn.cursor() as cur:
            for suffix in ("dagster", "mlflow"):
                cur.execute(sql.format(s=f"{self.schema}_{suffix}"))
        conn.close()

    def _create_schemas(self) -> None:
        self._each_schema("DROP SCHEMA IF EXISTS {s} CASCADE; CREATE SCHEMA {s}")

    def drop_schemas(self) -> None:
        if self.schema:
            self._each_schema("DROP SCHEMA IF EXISTS {s} CASCADE")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.home / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, env=self._env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        self.procs.append((name, proc))

    def stop(self) -> None:
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 30
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> "Stack":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        return (f"Dagster UI  http://127.0.0.1:{self.ports['dagster']}\n"
                f"MLflow UI   http://127.0.0.1:{self.ports['mlflow']}\n"
                f"S3 endpoint http://127.0.0.1:{self.ports['s3']} (bucket {self.bucket})\n"
                f"logs        {self.home / 'logs'}")


def up(home: Path, pg_url: str, settings: dict) -> int:
    """Run the stack in the foreground until Ctrl-C (the `make up` target)."""
    try:
        stack = Stack(home=home, pg_url=pg_url, settings=settings).start()
    except PreflightError as e:
        print(f"prodrl: {e}", file=sys.stderr)
        return 2
    print(stack.describe())
    print("Bootstrap with the `bootstrap_lab` job, send traffic with `lab_traffic_job`; the sensor starts "
          "rounds. Ctrl-C stops everything.")
    try:
        while all(p.poll() is None for _, p in stack.procs):
            time.sleep(1)
        print("a service exited; stopping the stack", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()
    return 0
