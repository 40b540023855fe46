"""Services on the simulated hosts (``cluster/hosts.py``): a Ray cluster across them."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from prodrl_pipelines.cluster.hosts import Host


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
