"""A multi-node Ray cluster on this machine, for `make up CLUSTER=ray` and the tests.

    python -m prodrl_pipelines.cluster.local --root DIR [--nodes 2] [--cpus 2]

Ray's own ``ray.cluster_utils.Cluster`` runs a head (with the dashboard, so jobs can be submitted)
and more raylets, each a node with its own id and resources, in a process of their own that keeps
them up until it gets SIGTERM/SIGINT. The process writes ``DIR/cluster.json`` (dashboard URL, GCS
address, node ids) once a job can be submitted. Every node registers on 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: otherwise Ray picks the machine's primary address), and
each gets its own agent and metrics ports (two raylets on one host would collide on the defaults).
Each cluster has a temp dir of its own (``/tmp/prodrl-ray-*``, removed when it stops), holding the
``ray_current_cluster`` file that Ray's job supervisor reads to point a job's driver at its cluster:
with several clusters in the shared ``/tmp/ray`` a job ran on whichever started last.

SIGUSR1 removes the newest worker node (its raylet killed, as when its machine goes away) and
SIGUSR2 adds one (``LocalRayCluster.remove_node`` / ``add_node``), for the failure tests. The head
keeps Ray's own failure detector (a node is dead after about 15 s of failed health checks, each
allowed 10 s): the raylets share two cores with everything else here, and a detector tuned for a
quiet machine declares healthy nodes dead under load. Whoever removes a node waits for the head to
say so (``wait_node_dead``) instead of counting on how fast it does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_args(cpus: float, head: bool, dashboard_port: int = 0, temp_dir: str | None = None) -> dict:
    args = {"num_cpus": cpus, "node_ip_address": "127.0.0.1", "dashboard_agent_listen_port": _free_port(),
            "metrics_export_port": _free_port(), "min_worker_port": 0, "max_worker_port": 0}
    if head:
        args.update(include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
                    ray_client_server_port=_free_port())
        if temp_dir:
            args["temp_dir"] = temp_dir
    return args


def _write_info(root: Path, info: dict) -> None:
    tmp = root / "cluster.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(root / "cluster.json")


def serve(root: Path, nodes: int, cpus: float) -> int:
    """Start the cluster, write ``cluster.json``, and keep it up until signalled."""
    import queue

    os.environ.update(LOOPBACK_ENV)
    from ray.cluster_utils import Cluster

    root.mkdir(parents=True, exist_ok=True)
    dashboard_port = _free_port()
    # a temp dir of its own: Ray's job supervisor points a job's driver at the cluster named in
    # <temp dir>/ray_current_cluster, the newest on the machine when clusters share /tmp/ray (another
    # test's, the stack's): a job then ran on a cluster it was not submitted to. Short, for Ray's
    # unix socket paths (107 bytes at most).
    temp_dir = tempfile.mkdtemp(prefix="prodrl-ray-", dir="/tmp")
    # ray.cluster_utils still writes the default temp dir's ray_current_cluster, which a custom temp dir
    # leaves uncreated: on a machine where no Ray ever ran the head's start failed (FileNotFoundError)
    from ray._private.utils import get_ray_address_file

    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    cluster = Cluster(initialize_head=True, shutdown_at_exit=False,
                      head_node_args=_node_args(cpus, head=True, dashboard_port=dashboard_port, temp_dir=temp_dir))
    for _ in range(nodes - 1):
        cluster.add_node(**_node_args(cpus, head=False))
    events: queue.Queue = queue.Queue()
    for sig, what in ((signal.SIGTERM, "stop"), (signal.SIGINT, "stop"), (signal.SIGUSR1, "remove"),
                      (signal.SIGUSR2, "add")):
        signal.signal(sig, lambda *_, what=what: events.put(what))
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        _wait_for_jobs(url, nodes)
        # the GCS answers on loopback; Ray reports it under the machine's primary address
        gcs = "127.0.0.1:" + cluster.address.rsplit(":", 1)[1]
        # where the job supervisor's "auto" looks (ray.cluster_utils writes only /tmp/ray's)
        from ray._private.utils import write_ray_address

        write_ray_address(gcs, temp_dir)
        info = {"dashboard_url": url, "gcs_address": gcs, "nodes": nodes, "cpus_per_node": cpus,
                "pid": os.getpid(), "session_dir": cluster.head_node.get_session_dir_path(), "temp_dir": temp_dir,
                "changes": 0,
                "worker_nodes": [n.node_id for n in cluster.worker_nodes]}
        _write_info(root, info)
        while True:
            try:
                what = events.get(timeout=1.0)  # a timeout: the signal handlers run between waits
            except queue.Empty:
                continue
            if what == "stop":
                break
            if what == "remove" and cluster.worker_nodes:
                node = list(cluster.worker_nodes)[-1]
                cluster.remove_node(node, allow_graceful=False)
                try:
                    _wait_node_dead(url, node.node_id)
                except RuntimeError as e:  # said in the log; the cluster stays up for whoever waits on it
                    print(e, file=sys.stderr, flush=True)
                info["removed"] = node.node_id
            elif what == "add":
                info["added"] = cluster.add_node(**_node_args(cpus, head=False)).node_id
            info.update(changes=info["changes"] + 1, worker_nodes=[n.node_id for n in cluster.worker_nodes])
            _write_info(root, info)
    finally:
        for node in list(cluster.worker_nodes):  # not graceful: a test cluster holds nothing to drain
            cluster.remove_node(node, allow_graceful=False)
        cluster.shutdown()
        (root / "cluster.json").unlink(missing_ok=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


def _wait_for_jobs(url: str, nodes: int, timeout_s: float = 120.0) -> None:
    """Until the dashboard answers the job API and every node is alive."""
    import httpx

    deadline, last = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/api/jobs/", timeout=5)
            alive = [n for n in httpx.get(f"{url}/nodes?view=summary", timeout=5).json()
                     .get("data", {}).get("summary", []) if n.get("raylet", {}).get("state") == "ALIVE"]
            if r.status_code == 200 and len(alive) >= nodes:
                return
            last = f"jobs API {r.status_code}, {len(alive)}/{nodes} nodes alive"
        except (httpx.HTTPError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    raise RuntimeError(f"local Ray cluster at {url} not ready after {timeout_s:.0f}s ({last})")


def _node_states(url: str) -> dict[str, str]:
    import httpx

    summary = httpx.get(f"{url}/nodes?view=summary", timeout=10).json().get("data", {}).get("summary", [])
    return {n.get("raylet", {}).get("nodeId", ""): n.get("raylet", {}).get("state", "") for n in summary}


def _wait_node_dead(url: str, node_id: str, timeout_s: float = 300.0) -> None:
    """Until the head says the removed node is dead: its replicas, actors and placement groups are
    then rescheduled, whatever the machine's load (Ray's detector takes ~15 s on a quiet one)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if _node_states(url).get(node_id, "DEAD") == "DEAD":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"Ray head at {url} still lists removed node {node_id} as alive after {timeout_s:.0f}s")


# what Ray says when a node's raylet did not register with the GCS within its fixed 30 s
SLOW_START = "timed out during startup"


class _SlowStart(RuntimeError):
    """The cluster's start ran past Ray's fixed raylet registration wait (a loaded machine)."""


class LocalRayCluster:
    """A local cluster in its own process (``serve``): ``start()`` returns once a job can be
    submitted; ``stop()`` stops only what it started."""

    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: float = 2):
        self.root, self.nodes, self.cpus = Path(root), nodes, cpus_per_node
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    @property
    def dashboard_url(self) -> str:
        return self.info["dashboard_url"]

    @property
    def gcs_address(self) -> str:
        return self.info["gcs_address"]

    def start(self, timeout_s: float = 180.0, attempts: int = 3) -> "LocalRayCluster":
        """Start the cluster's process and wait for it. Ray gives a new node's raylet a fixed 30 s to
        register with the GCS (``ray._private.node``, not configurable); on a loaded machine a start
        can run past it, so a start that failed that way is tried again (``attempts`` in all)."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(deadline)
            except _SlowStart as e:
                if attempt == attempts or time.monotonic() > deadline:
                    raise RuntimeError(str(e)) from None
        raise AssertionError("unreachable")

    def _start_once(self, deadline: float) -> "LocalRayCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "cluster.json").unlink(missing_ok=True)
        log_path = self.root / "cluster.log"
        start_at = log_path.stat().st_size if log_path.exists() else 0
        log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prodrl_pipelines.cluster.local", "--root", str(self.root),
             "--nodes", str(self.nodes), "--cpus", str(self.cpus)],
            env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **LOOPBACK_ENV},  # another cluster's
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        while not (self.root / "cluster.json").exists():
            if self.proc.poll() is not None:
                with open(log_path, "rb") as f:
                    f.seek(start_at)
                    tail = f.read().decode(errors="replace")[-3000:]
                self._kill_session()  # what the failed start left (a head's GCS, dashboard, agents)
                error = _SlowStart if SLOW_START in tail else RuntimeError
                raise error(f"local Ray cluster exited with {self.proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"local Ray cluster not up in time (log: {log_path})")
            time.sleep(0.3)
        self.info = json.loads((self.root / "cluster.json").read_text())
        return self

    def _change(self, sig: int, key: str, timeout_s: float = 60.0) -> str:
        info = json.loads((self.root / "cluster.json").read_text())
        before = info["changes"]
        os.kill(self.proc.pid if self.proc is not None else info["pid"], sig)  # a cluster started elsewhere: by its pid
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = json.loads((self.root / "cluster.json").read_text())
            if info["changes"] > before:
                self.info = info
                return info.get(key, "")
            time.sleep(0.2)
        raise RuntimeError(f"local Ray cluster did not {key[:-1]} a node within {timeout_s:.0f}s")

    def remove_node(self, timeout_s: float = 360.0) -> str:
        """Kill the newest worker node's raylet (its machine gone) and wait until the head has declared
        it dead; its node id."""
        return self._change(signal.SIGUSR1, "removed", timeout_s)

    def add_node(self, timeout_s: float = 180.0) -> str:
        """Add a worker node like the others; its node id."""
        return self._change(signal.SIGUSR2, "added", timeout_s)

    def _kill_session(self) -> None:
        """SIGKILL what is left in the cluster process's session (its process group, by the pid we
        started it with): Ray's own processes outlive a cluster process that died."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            self._kill_session()
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:  # its whole session: the raylets, GCS and workers it started
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> "LocalRayCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, type=Path, help="where cluster.json and the log go")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus", type=float, default=2, help="CPUs each node offers")
    a = ap.parse_args(argv)
    return serve(a.root, a.nodes, a.cpus)


if __name__ == "__main__":
    raise SystemExit(main())
