"""A local production-shaped stack on loopback, the whole loop in one command.

    prodrl up --home runs/stack --pg-url postgresql+psycopg2://...      (make up)

Services, in start order:
- S3: ``moto_server`` (bucket ``prodrl``; its in-memory objects are mirrored to ``<home>/s3_snapshot``
  on stop and restored on start, ``s3_snapshot``);
- MLflow: a tracking server with its backend in PostgreSQL schema ``<prefix>_mlflow`` and artifacts
  on S3;
- Dagster: ``dagster-webserver`` and ``dagster-daemon`` on the instance of this repo's dagster.yaml,
  storage in schema ``<prefix>_dagster``; the daemon runs the data-volume sensor;
- the deployment: ``prodrl serve`` on the live export and ``prodrl record`` in front of it
  (``serving``), up as soon as a policy is live;
- with ``--cluster ray`` (``make up CLUSTER=ray``): a local Ray cluster of two nodes (``cluster.local``)
  with its dashboard; the rounds train, evaluate and score there as Ray jobs (``cluster`` settings).

Each schema is created if missing and kept (``postgres``), so ``prodrl up`` run again on the same
home and database continues the same instance, runs, registry and stores. Ports: the preferred ones
(Dagster 3000, MLflow 5000, S3 9000, deployment 8000, recorder 8100) when free, else free ones; the
URLs, pids and the token's source are printed and written to ``<home>/stack.json``. Ctrl-C or
SIGTERM stops every process (deployment first, so the recorder flushes; then Dagster; then the S3
mirror is saved; then MLflow and S3).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from prodrl_pipelines.storage.atomic import write_json_atomic
from prodrl_pipelines.config import environment
from prodrl_pipelines.config.preflight import PreflightError, check_postgres, redact
from prodrl_pipelines.stack import s3_snapshot
from prodrl_pipelines.stack.postgres import prepare_schemas, with_schema
from prodrl_pipelines.deploy_targets.processes import ManagedProcess, pick_port, pick_port_range, stop_all
from prodrl_pipelines.config.environment import RECORDER_TOKEN
from prodrl_pipelines.stack.serving import LiveServing

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFERRED_PORTS = {"dagster": 3000, "mlflow": 5000, "s3": 9000, "deployment": 8000, "recorder": 8100}
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def mlflow_server_command(backend_store_uri: str, artifacts_destination: str, port: int) -> list[str]:
    """The MLflow tracking server of the stack: registry and runs in PostgreSQL, artifacts proxied to S3."""
    return [str(BIN / "mlflow"), "server", "--backend-store-uri", backend_store_uri,
            "--artifacts-destination", artifacts_destination, "--host", "127.0.0.1", "--port", str(port),
            "--workers", "1"]


@dataclass
class Stack:
    home: Path
    pg_url: str  # postgresql+psycopg2://... (the Dagster instance and the MLflow backend)
    settings: dict = field(default_factory=dict)  # ProdRLSettings fields
    schema: str = "prodrl"  # prefix of the services' schemas: <schema>_dagster, <schema>_mlflow
    sensor_interval_s: int = 15
    bucket: str = "prodrl"
    preferred_ports: dict = field(default_factory=lambda: dict(PREFERRED_PORTS))
    log: object = print
    procs: list[ManagedProcess] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    serving: LiveServing | None = None
    token_source: str = ""
    schemas: dict = field(default_factory=dict)
    cluster: str = "local"  # "ray": a local two-node Ray cluster runs the rounds' heavy steps
    ray: object = None  # its LocalRayCluster

    @property
    def env(self) -> dict:
        return self._env

    def _token(self) -> str:
        if environment.recorder_token():
            self.token_source = f"${RECORDER_TOKEN}"
            return environment.recorder_token()
        path = self.home / "recorder_token"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(16) + "\n")
        self.token_source = f"{path} (generated once, kept; or set ${RECORDER_TOKEN})"
        return path.read_text().strip()

    def _s3_client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.urls["s3"], region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    @property
    def urls(self) -> dict[str, str]:
        return {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}

    def start(self) -> "Stack":
        t0 = time.monotonic()
        check_postgres(self.pg_url, "--pg-url / DAGSTER_PG_URL")  # fail before anything starts
        self.schemas = prepare_schemas(self.pg_url, self.schema)
        self.home = self.home.resolve()
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        dh = self.home / "dagster_home"
        dh.mkdir(exist_ok=True)
        shutil.copy(REPO / "dagster.yaml", dh / "dagster.yaml")
        token = self._token()
        self.settings = fleet_settings(self.settings)
        for name, pref in self.preferred_ports.items():
            if name == "deployment":  # two ports per replica (blue/green), and a pair for a canary
                self.ports[name] = pick_port_range(2 * int(self.settings["replicas"]) + 2, pref)
            else:
                self.ports[name] = pick_port(pref)
        self.settings["target_port"] = self.ports["deployment"]
        s3 = self.urls["s3"]
        os.environ.update(S3_CREDENTIALS)  # this process's own S3 clients (the deployment poller) talk to moto
        if self.cluster == "ray":  # its jobs inherit the S3 credentials set just above
            self._start_ray()
        s3_store = {"s3_bucket": self.bucket, "s3_prefix": "prodrl", "s3_endpoint_url": s3, "s3_region": "us-east-1"}
        self._env = {
            **os.environ, **S3_CREDENTIALS,
            "DAGSTER_HOME": str(dh), "DAGSTER_PG_URL": with_schema(self.pg_url, self.schemas["dagster"]),
            **environment.write(settings={**self.settings, "home": str(self.home)}, store=s3_store,
                                home=str(self.home)),
            environment.SENSOR_INTERVAL: str(self.sensor_interval_s),
            "MLFLOW_TRACKING_URI": self.urls["mlflow"], "MLFLOW_UI_URL": self.urls["mlflow"],
            "MLFLOW_S3_ENDPOINT_URL": s3, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "PYTHONUNBUFFERED": "1",
        }
        self._env.pop(RECORDER_TOKEN, None)  # only the deployment's recorder gets it
        self._spawn("s3", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.ports["s3"])]).wait_http(s3)
        client = self._s3_client()
        client.create_bucket(Bucket=self.bucket)
        restored = s3_snapshot.restore(client, self.bucket, self.home / "s3_snapshot")
        if restored:
            self.log(f"S3: restored {restored} objects from {self.home / 's3_snapshot'}")
        self._spawn("mlflow", mlflow_server_command(with_schema(self.pg_url, self.schemas["mlflow"]),
                                                    f"s3://{self.bucket}/mlflow", self.ports["mlflow"])
                    ).wait_http(f"{self.urls['mlflow']}/health")
        self._spawn("webserver", [str(BIN / "dagster-webserver"), "-m", "prodrl_pipelines.definitions",
                                  "-h", "127.0.0.1", "-p", str(self.ports["dagster"])]
                    ).wait_http(f"{self.urls['dagster']}/server_info", timeout_s=180)
        self._spawn("daemon", [str(BIN / "dagster-daemon"), "run", "-m", "prodrl_pipelines.definitions"])
        def round_services():
            from prodrl_pipelines.config.settings import settings_from_flat
            from prodrl_pipelines.loop.services import build_services
            from prodrl_pipelines.storage.locations import StoreLocation

            settings = settings_from_flat({**self.settings, "home": str(self.home)})
            return build_services(settings, StoreLocation(**s3_store))

        from prodrl_pipelines.stack.prometheus_config import write_config

        write_config(self.home)  # scrape targets kept current by the live serving's polls
        self.serving = LiveServing(env=self._env, home=self.home, record_port=self.ports["recorder"], token=token,
                                   services=round_services, log=self.log).start()
        self.startup_s = time.monotonic() - t0
        self.write_state()
        return self

    def _start_ray(self) -> None:
        from prodrl_pipelines.cluster.local import LocalRayCluster

        self.log("Ray: starting a local cluster of two nodes ...")
        self.ray = LocalRayCluster(self.home / "ray", nodes=2, cpus_per_node=2).start()
        self.ports["ray"] = int(self.ray.dashboard_url.rsplit(":", 1)[1])
        # training ranks one per node; evaluation and scoring on two workers each, the held-out
        # episodes in batches of 64 so that both evaluation workers get some; the fleet's replicas
        # placed on the cluster, each owned by a Ray actor, reserving half a CPU (wherever they land,
        # a CPU stays free on each node for a training rank)
        self.settings = {"cluster_workers": 2, "cluster_eval_workers": 2, "cluster_scoring_workers": 2,
                         "eval_episode_batch": 64, "replica_placement": "ray", "replica_cpus": 0.5,
                         **self.settings, "cluster": "ray", "cluster_address": self.ray.dashboard_url}
        # where this process, the daemon's runs and the deployment connect as Ray drivers (the
        # cluster itself was started without it)
        os.environ["RAY_ADDRESS"] = self.ray.gcs_address

    def _spawn(self, name: str, cmd: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, cmd, self._env, self.home / "logs" / f"{name}.log", cwd=REPO)
        self.procs.append(proc)
        return proc

    def all_processes(self) -> list[ManagedProcess]:
        return self.procs + (self.serving.processes() if self.serving else [])

    def state(self) -> dict:
        return {
            "urls": {**self.urls, "recorder": f"{self.urls['recorder']}/v1"},
            "pids": {**{p.name: p.pid for p in self.all_processes()},
                     **({"ray cluster": self.ray.proc.pid} if self.ray is not None and self.ray.proc else {}),
                     **(self.serving.server_pids() if self.serving else {})},
            "stack_pid": os.getpid(),
            "token_source": self.token_source,
            "schemas": self.schemas, "database": redact(self.pg_url),
            "deployed_version": self.serving.version if self.serving else None,
        }

    def write_state(self) -> None:
        write_json_atomic(self.home / "stack.json", self.state(), durable=False)

    def stop(self) -> None:
        if self.serving is not None:
            self.serving.stop()  # the recorder flushes its WAL to S3 before S3 goes
        by_name = {p.name: p for p in self.procs}
        stop_all([p for p in self.procs if p.name in ("daemon", "webserver")])
        s3 = by_name.get("s3")
        if s3 is not None and s3.alive():
            try:
                n = s3_snapshot.save(self._s3_client(), self.bucket, self.home / "s3_snapshot")
                self.log(f"S3: saved {n['objects']} objects ({n['bytes'] / 1e6:.1f} MB, {n['downloaded']} new) "
                         f"to {self.home / 's3_snapshot'}")
            except Exception as exc:  # noqa: BLE001 - still stop everything; say what was not kept
                self.log(f"S3: could not save the bucket snapshot ({type(exc).__name__}: {exc}); "
                         f"the previous snapshot is kept")
        stop_all([p for p in self.procs if p.name not in ("daemon", "webserver")])
        self.procs.clear()
        if self.ray is not None:  # last: no step is left to run on it
            self.ray.stop()
            self.ray = None

    def __enter__(self) -> "Stack":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        u = self.urls
        return "\n".join([
            f"Dagster UI    {u['dagster']}",
            f"MLflow UI     {u['mlflow']}",
            f"recorder      {u['recorder']}/v1   (OpenAI-compatible; send traffic and POST /v1/feedback here)",
            f"  bearer token  {self.token_source}",
            f"deployment    {self.settings['replicas']} x {self.settings['target']}, ports {self.ports['deployment']}-"
            f"{self.ports['deployment'] + 2 * int(self.settings['replicas']) - 1} (blue/green per replica, rolling "
            "updates), reached through the recorder once a policy is live",
            f"S3 endpoint   {u['s3']}   (bucket {self.bucket}; mirrored to {self.home / 's3_snapshot'} on stop)",
            f"PostgreSQL    {redact(self.pg_url)}   (schemas {self.schemas['dagster']}, {self.schemas['mlflow']})",
            *([f"Ray dashboard {u['ray']}   (2 local nodes; the rounds' training, evaluation and scoring jobs)"]
              if "ray" in u else []),
            f"state, logs   {self.home / 'stack.json'}, {self.home / 'logs'} (requests.jsonl: one line per call)",
            f"metrics       {u['recorder']}/metrics, each replica's /metrics; Prometheus: prometheus "
            f"--config.file={self.home / 'prometheus' / 'prometheus.yml'} (docs/observability.md)",
        ])


def fleet_settings(settings: dict) -> dict:
    """The stack's deployment: a fleet of managed servers (``prodrl-serve`` unless the settings name
    another managed target), 2 replicas unless they say how many."""
    from prodrl_pipelines.deploy_targets import FLEET_TARGETS

    out = dict(settings)
    if out.get("target") not in FLEET_TARGETS:
        out["target"] = "prodrl-serve"
    out.setdefault("replicas", 2)
    out.setdefault("server_args", ["--max-batch-size", "256"])
    return out


def up(home: Path, pg_url: str, settings: dict, schema: str = "prodrl", cluster: str = "local") -> int:
    """Run the stack in the foreground until Ctrl-C or SIGTERM (the `make up` target)."""
    def on_term(signum, frame):
        # the first signal starts the shutdown; later ones (make forwards a TERM to its recipe, a
        # second Ctrl-C) are ignored from this instant, so they cannot cut the shutdown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    # explicit, so a stack started from a script (where SIGINT may be ignored) still stops on Ctrl-C
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    stack = Stack(home=home, pg_url=pg_url, settings=settings, schema=schema, cluster=cluster,
                  log=lambda m: print(m, flush=True))
    try:
        stack.start()
    except PreflightError as e:
        print(f"prodrl: {e}", file=sys.stderr)
        stack.stop()
        return 2
    except KeyboardInterrupt:
        stack.stop()
        return 130
    except BaseException:
        stack.stop()
        raise
    print(stack.describe(), flush=True)
    print(f"up in {stack.startup_s:.0f}s. Next: launch the `bootstrap` job in the Dagster UI; send traffic "
          "with any OpenAI client to the recorder; the data-volume sensor starts rounds. Ctrl-C stops everything.",
          flush=True)
    code = 0
    try:
        last = None
        while all(p.alive() for p in stack.procs) and (stack.ray is None or stack.ray.proc.poll() is None):
            now = (stack.serving.version, tuple(p.pid for p in stack.all_processes()),
                   tuple(sorted(stack.serving.server_pids().items())))
            if now != last:  # a (re)deploy: new version, new pids
                last = now
                stack.write_state()
            time.sleep(1)
        dead = [p.name for p in stack.procs if not p.alive()] + (
            ["ray cluster"] if stack.ray is not None and stack.ray.proc.poll() is not None else [])
        print(f"{', '.join(dead)} exited; stopping the stack (see {stack.home / 'logs'})", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("stopping the stack ...", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # also when the loop ended without a signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        print("stopped.", flush=True)
    return code
