"""Services on the simulated hosts (``cluster/hosts.py``): a Ray cluster across them, and PostgreSQL on
a host of its own (the database every host shares, as in a real cluster)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from prodrl_pipelines.cluster.hosts import SUBNET, Host


def start_ray(head: Host, workers: list[Host], env: dict, cpus: int = 2, timeout_s: float = 300.0) -> tuple[str, list]:
    """A Ray head on ``head`` and a worker on each of ``workers`` (``ray start --block``, ``cpus`` CPUs
    each, ``env`` their environment: the node's own); returns the dashboard URL and the processes,
    once every node is alive (asked from ``head``). The processes end with their hosts."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    procs = [head.popen([ray, "start", "--head", "--block", "--node-ip-address", head.address, "--port", "6379",
                         "--dashboard-host", head.address, "--include-dashboard=true", "--num-cpus", str(cpus),
                         "--disable-usage-stats"], env=env, log=head.tmp / "ray-head.log")]
    dashboard = f"http://{head.address}:8265"

    def alive() -> int:
        out = head.run(["curl", "-s", "-m", "5", f"{dashboard}/nodes?view=summary"]).stdout
        try:
            summary = json.loads(out).get("data", {}).get("summary", [])
        except ValueError:
            return 0
        return sum(n.get("raylet", {}).get("state") == "ALIVE" for n in summary)

    deadline = time.monotonic() + timeout_s
    while alive() < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head on {head.name} did not come up (log: {head.tmp / 'ray-head.log'})")
        time.sleep(0.3)
    for w in workers:
        procs.append(w.popen([ray, "start", "--block", "--address", f"{head.address}:6379", "--node-ip-address",
                              w.address, "--num-cpus", str(cpus), "--disable-usage-stats"], env=env,
                             log=w.tmp / "ray-worker.log"))
    while alive() < 1 + len(workers):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{1 + len(workers)} Ray nodes not alive within {timeout_s:.0f}s")
        time.sleep(0.3)
    return dashboard, procs


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin directory (Debian's layout), else None."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else None


class HostPostgres:
    """A PostgreSQL server on ``host`` (its data in the host's own /tmp, owned by the ``postgres``
    user, trusting the hosts' subnet), stopped and started again by pid: a database restart is one
    of the faults a cluster has. ``url`` is what the other hosts connect to."""

    def __init__(self, host: Host, port: int = 5432, user: str = "postgres") -> None:
        self.host, self.port, self.user = host, port, user
        self.bin = postgres_bin()
        if self.bin is None:
            raise RuntimeError("no PostgreSQL server installed (/usr/lib/postgresql/*/bin/postgres)")
        self.proc = None
        self.url = f"postgresql://{user}@{host.address}:{port}/postgres"

    def _as_postgres(self, argv: list[str]) -> list[str]:
        # setpriv execs (runuser forks and stands between the pid we signal and the server)
        return ["setpriv", "--reuid", self.user, "--regid", self.user, "--init-groups", *argv]

    def init(self) -> "HostPostgres":
        self.host.run(self._as_postgres([str(self.bin / "initdb"), "-D", "/tmp/pg", "-A", "trust", "-U", self.user,
                                         "--no-sync"]), timeout=300, check=True)
        self.host.run(["sh", "-c", f"echo 'host all all {SUBNET}.0/24 trust' >> /tmp/pg/pg_hba.conf"], check=True)
        return self.start()

    def start(self, timeout_s: float = 120.0) -> "HostPostgres":
        self.proc = self.host.popen(self._as_postgres([
            str(self.bin / "postgres"), "-D", "/tmp/pg", "-h", self.host.address, "-p", str(self.port), "-k", "/tmp",
            "-c", "fsync=off"]), log=self.host.tmp / "postgres.log")
        deadline = time.monotonic() + timeout_s
        while self.host.run([str(self.bin / "pg_isready"), "-h", self.host.address, "-p", str(self.port)]).returncode:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"PostgreSQL on {self.host.name} did not start "
                                   f"(log: {self.host.tmp / 'postgres.log'})")
            time.sleep(0.2)
        return self

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM by pid (PostgreSQL's smart shutdown is SIGTERM: it waits for clients; fast is SIGINT:
        open connections are cut, as a restart cuts them), SIGKILL after ``grace_s``."""
        if self.proc is not None:
            import signal
            import subprocess

            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
            self.proc = None


# A lab round small enough for simulated hosts on 2 shared cores: what is shown is where each step
# runs, not learning. Training ranks one per Ray host, evaluation and scoring on Ray, the fleet of two
# replicas placed on the Ray hosts.
ROUND_SETTINGS = {
    "lab_size": "tiny", "lab_sft_steps": 5, "steps_per_round": 2, "batch_size": 8, "heldout_size": 8,
    "max_tokens": 8, "learning_rate": 1e-3, "gate_tolerance": 1.0,
    "cluster": "ray", "cluster_workers": 2, "cluster_cpus_per_worker": 0.5, "cluster_placement": "spread",
    "cluster_eval_workers": 2, "cluster_scoring_workers": 1,
    "target": "prodrl-serve", "target_port": 18100, "replicas": 2, "max_unavailable": 1, "probe_prompts": 2,
    "export_scheme": "bf16", "replica_placement": "ray", "replica_spread": True,
}


def round_from_host(host: Host, env: dict, dashboard: str, pg_url: str, bucket: str = "round",
                    name: str = "round", timeout_s: float = 1800.0) -> dict:
    """Bootstrap and one round run on ``host`` as Dagster's run worker runs them (``prodrl demo``: the
    data-volume sensor's evaluation, then the round job in process), its Dagster instance and the
    fleet's endpoint record in PostgreSQL at ``pg_url``, its store in ``bucket`` on the S3 endpoint of ``env``
    (``PRODRL_S3_ENDPOINT_URL``), its heavy steps and its fleet on the Ray cluster at ``dashboard``.
    Returns ``fleet_driver round-report`` of round 1, with the seconds it all took."""
    env = {k: v for k, v in env.items() if k != "PRODRL_SETTINGS_JSON"}
    env.update({"PRODRL_S3_BUCKET": bucket, "PRODRL_DAGSTER_HOME": str(Path(__file__).resolve().parents[2]),
                "DAGSTER_PG_URL": pg_url.replace("postgresql://", "postgresql+psycopg2://")})
    # the endpoint record in PostgreSQL: the recorder and the fleet keeper (a Ray actor on h2 or h3) read it
    (host.tmp / f"{name}-settings.json").write_text(json.dumps({**ROUND_SETTINGS, "cluster_address": dashboard,
                                                                "endpoint_store": pg_url, "endpoint_name": name}))
    python = sys.executable
    host.run([python, "-c", "import boto3, os, sys; boto3.client('s3', endpoint_url=os.environ["
              "'PRODRL_S3_ENDPOINT_URL']).create_bucket(Bucket=sys.argv[1])", bucket], env=env, check=True)
    t0 = time.monotonic()
    res = host.run([str(Path(python).with_name("prodrl")), "demo", "--settings", f"/tmp/{name}-settings.json",
                    "--runs-dir", "/tmp/runs", "--name", name, "--rounds", "1"], env=env, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"the round on {host.name} exited {res.returncode}:\n{res.stdout[-3000:]}\n"
                           f"{res.stderr[-6000:]}")
    seconds = time.monotonic() - t0
    rep = host.run([python, "-m", "prodrl_pipelines.cluster.fleet_driver", "round-report", f"/tmp/runs/{name}",
                    "round-000001"], env=env, timeout=300)
    if rep.returncode != 0:
        raise RuntimeError(f"round-report on {host.name} exited {rep.returncode}:\n{rep.stderr[-4000:]}")
    return {**json.loads(rep.stdout.strip().splitlines()[-1]), "seconds": round(seconds, 1)}
