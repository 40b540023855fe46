"""Seconds from "deploy" to "probe passed" for each deploy target, and what steady traffic sees
during the switch: 4 clients send completions through ``prodrl record --follow`` the whole time,
each pausing 20 ms between calls (4 clients without pauses saturate the 2 cores, and a second vLLM
then does not finish booting within 300 s: vllm-restart rolls back, 0 requests failed);
requests that failed, and the slowest request, while the target switched (side by side in one run).

    python bench/deploy_switch.py [--targets prodrl-serve vllm-restart vllm-reload]

Targets: ``prodrl-serve`` and ``vllm-restart`` (blue/green managed servers), ``vllm-reload`` (in
place on a running dev-mode vLLM; on vLLM's CPU backend the probe finds the reloaded weights wrong
and the target reloads the previous ones: the row says so). Last line:
``deploy_switch: prodrl-serve seconds=X failed=F; vllm-restart seconds=X failed=F; vllm-reload seconds=X failed=F``
(the targets measured).

    python bench/deploy_switch.py --replicas 1 2 3 [--seconds 10]

A fleet of N ``prodrl serve`` replicas updated in waves of one (``max_unavailable`` 1) under the same
traffic: requests failed during the rollout, p99 latency and capacity (answered requests per second)
during the rollout against the ``--seconds`` of steady state just before it, and seconds to full rollout. Last line:
``deploy_switch: replicas=N failed=F p99_ratio=X capacity_ratio=X`` for the largest N.

    python bench/deploy_switch.py --ray --replicas 3

The same fleet measured twice in one run, first on loopback (``replica_placement: local``) and then placed on a
two-node local Ray cluster the bench starts and stops (``replica_placement: ray``, 2 CPUs per node, 1 per
replica). Last line: ``deploy_switch: placement=ray nodes=2 replicas=N failed=F p99_ratio=X capacity_ratio=X``.

Smoke size (``--smoke``, bench/_smoke.py): a fleet of 1 (no vLLM), tiny dense policies, 1 s of steady state.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import parse_args  # noqa: E402
from _vllm import SERVER_ARGS, dense_exports, vllm_python_or_exit  # noqa: E402

from prodrl_pipelines.deploy_targets import endpoint_file, make_target  # noqa: E402
from prodrl_pipelines.deploy_targets.base import DeployError, wait_healthy  # noqa: E402
from prodrl_pipelines.deploy_targets.rollout import roll_out  # noqa: E402
from prodrl_pipelines.deploy_targets.server_records import stop_process_group  # noqa: E402
from prodrl_pipelines.engines.server import BackgroundServer  # noqa: E402
from prodrl_pipelines.engines.vllm_client import vllm_serve_command, vllm_serve_env  # noqa: E402
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app  # noqa: E402
from prodrl_pipelines.config.settings import Settings  # noqa: E402
from prodrl_pipelines.deploy_targets.processes import pick_port, pick_port_range  # noqa: E402

PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42, 9], [1, 12, 13], [1, 20, 21, 22, 23]]
TARGETS = ("prodrl-serve", "vllm-restart", "vllm-reload")


class Traffic:
    def __init__(self, url: str, workers: int = 4, pause_s: float = 0.02) -> None:
        self.pause_s = pause_s
        self.events: list[tuple[float, float, bool]] = []  # (start, seconds, ok)
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(workers)
        self.futs = [self.pool.submit(self._run, url, i) for i in range(workers)]

    def _run(self, url: str, i: int) -> None:
        n = 0
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer t"}, timeout=300) as h:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = h.post("/v1/completions", json={"model": "any", "prompt": PROMPTS[n % 4], "max_tokens": 8,
                                                         "logprobs": 8, "seed": n}).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.events.append((t0, time.monotonic() - t0, ok))
                n += 1
                time.sleep(self.pause_s)

    def finish(self) -> None:
        self.stop.set()
        for f in self.futs:
            f.result()
        self.pool.shutdown()

    def rate_and_p99(self, a: float, b: float) -> tuple[float, float]:
        """Answered requests per second ending in [a, b], and the p99 latency of those."""
        done = sorted(s for t, s, ok in self.events if ok and a <= t + s <= b)
        if not done:
            return 0.0, float("nan")
        return len(done) / (b - a), done[min(len(done) - 1, int(0.99 * len(done)))]

    def window(self, a: float, b: float) -> tuple[int, int, float]:
        ev = [e for e in self.events if a <= e[0] + e[1] and e[0] <= b]
        return len(ev), sum(not ok for _, _, ok in ev), max((s for _, s, _ in ev), default=0.0)


def measure(name: str, settings: Settings, exports: list[Path]) -> tuple[str, str]:
    """The target's row, and its part of the last line."""
    target = make_target(settings)
    roll_out(settings, target, exports[0], "v0", PROMPTS)  # the starting deployment (not measured)
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(settings.home_path).path),
                                            store_dir=str(settings.home_path / "store"), token="t", top_logprobs=8))
    with BackgroundServer(app) as srv:
        traffic = Traffic(srv.url)
        time.sleep(2.0)
        t0 = time.monotonic()
        try:
            ro = roll_out(settings, target, exports[1], "v1", PROMPTS)
            outcome, seconds = f"probe passed (mean {ro.probe.mean_abs:.4f})", ro.seconds
        except DeployError as e:
            outcome, seconds = f"rolled back: {getattr(e, 'rollback', e)}", time.monotonic() - t0
        t1 = time.monotonic()
        time.sleep(2.0)
        traffic.finish()
    n, failed, slowest = traffic.window(t0, t1)
    if hasattr(target, "stop"):
        target.stop()
    return (f"{name:13s} {seconds:7.2f} s to probe   requests during switch {n:4d}, failed {failed:3d}, "
            f"slowest {slowest:6.2f} s   {outcome}", f"{name} seconds={seconds:.2f} failed={failed}")


def measure_fleet(n: int, root: Path, exports: list[Path], placement: str = "local", cluster=None,
                  steady_s: float = 10.0) -> dict:
    """One rolling update of a fleet of ``n``: ``placement`` local (loopback child processes) or ray (on the
    Ray cluster of ``cluster``, a ``ClusterSettings``); ``steady_s`` of steady state measured before it."""
    s = Settings(home=str(root / f"fleet{n}-{placement}"), deploy={
        "num_top_logprobs": 8, "max_tokens": 8, "probe_prompts": 4, "export_scheme": "bf16", "target": "prodrl-serve",
        "target_port": pick_port_range(2 * n + 2), "replicas": n, "max_unavailable": 1,
        "replica_placement": placement})
    target = make_target(s, cluster)
    try:
        roll_out(s, target, exports[0], "v0", PROMPTS)
        app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                                store_dir=str(s.home_path / "store"), token="t", top_logprobs=8))
        with BackgroundServer(app) as srv:
            traffic = Traffic(srv.url)
            try:
                time.sleep(min(3.0, steady_s))  # warm
                s0 = time.monotonic()
                time.sleep(steady_s)  # the steady state
                t0 = time.monotonic()
                ro = roll_out(s, target, exports[1], "v1", PROMPTS)
                t1 = time.monotonic()
                time.sleep(min(2.0, steady_s))
            finally:
                traffic.finish()
    finally:
        target.stop()
    left = [r for r in target.currents() if r is not None]
    if left:
        print(f"WARNING: {placement} fleet of {n}: {len(left)} replica(s) still running after stop(): {left}")
    steady_rate, steady_p99 = traffic.rate_and_p99(s0, t0)
    rate, p99 = traffic.rate_and_p99(t0, t1)
    total, failed, _ = traffic.window(t0, t1)
    return {"placement": placement, "replicas": n, "failed": failed, "requests": total, "rollout_s": round(t1 - t0, 1),
            "waves": ro.waves, "p99_ratio": round(p99 / steady_p99, 2), "capacity_ratio": round(rate / steady_rate, 2),
            "steady_rps": round(steady_rate, 1), "rollout_rps": round(rate, 1)}


def ray_driver(cluster) -> object:
    """This process as a driver of the local Ray ``cluster`` (``LocalRayCluster``), as tests/test_ray_fleet.py
    sets it up: the ``ClusterSettings`` a fleet target places its replicas with."""
    from prodrl_pipelines.cluster.config import cluster_settings
    from prodrl_pipelines.cluster.local import LOOPBACK_ENV

    os.environ.update(LOOPBACK_ENV)  # before Ray is first imported
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # 127.0.0.1 stays 127.0.0.1
    os.environ["RAY_ADDRESS"] = "127.0.0.1:" + cluster.gcs_address.rpartition(":")[2]  # not the default GCS port
    return cluster_settings({"cluster": "ray", "cluster_address": cluster.dashboard_url})


def main_fleet(sizes: list[int], ray: bool = False, nodes: int = 2, steady_s: float = 10.0,
               policy: tuple[str, int] = ("demo-dense", 30)) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        exports = dense_exports(root, 2, *policy)
        if not ray:
            rows = [measure_fleet(n, root, exports, steady_s=steady_s) for n in sizes]
        else:
            from prodrl_pipelines.cluster.local import LocalRayCluster

            # both placements measured while the cluster is up: the same background load on the 2 cores
            local_ray = LocalRayCluster(root / "ray", nodes=nodes, cpus_per_node=2)
            try:
                t = time.monotonic()
                local_ray.start()
                print(f"local Ray cluster: {nodes} nodes up in {time.monotonic() - t:.1f} s ({local_ray.dashboard_url})")
                cluster = ray_driver(local_ray)
                for n in sizes:
                    rows.append(measure_fleet(n, root, exports, steady_s=steady_s))
                    rows.append(measure_fleet(n, root, exports, "ray", cluster, steady_s=steady_s))
            finally:
                if "ray" in sys.modules:  # this driver's connection, then the cluster (its raylets, GCS, workers)
                    sys.modules["ray"].shutdown()
                local_ray.stop()
    for r in rows:
        print(f"{r['placement'] + ' ' if ray else ''}replicas {r['replicas']}: {r['rollout_s']:6.1f} s to full rollout "
              f"({r['waves']} waves), requests {r['requests']:4d}, failed {r['failed']}, p99 x{r['p99_ratio']}, "
              f"capacity x{r['capacity_ratio']} ({r['rollout_rps']} vs {r['steady_rps']} req/s steady)")
    last = rows[-1]
    where = f"placement=ray nodes={nodes} " if ray else ""
    print(f"deploy_switch: {where}replicas={last['replicas']} failed={last['failed']} p99_ratio={last['p99_ratio']} "
          f"capacity_ratio={last['capacity_ratio']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, nargs="*", help="measure fleets of these sizes (prodrl serve) instead")
    ap.add_argument("--ray", action="store_true", help="with --replicas: each fleet on loopback, then placed on a "
                                                       "two-node local Ray cluster (default --replicas 3)")
    ap.add_argument("--seconds", type=float, default=10.0, help="with --replicas: steady state before each rollout")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--policy-size", default="demo-dense", help="the dense lab policies deployed")
    ap.add_argument("--sft-steps", type=int, default=30, help="their warm start")
    args = parse_args(ap, replicas=[1], seconds=1.0, policy_size="tiny-dense", sft_steps=2)
    policy = (args.policy_size, args.sft_steps)
    if args.ray:
        return main_fleet(args.replicas or [3], ray=True, steady_s=args.seconds, policy=policy)
    if args.replicas:
        return main_fleet(args.replicas, steady_s=args.seconds, policy=policy)
    py = vllm_python_or_exit() if set(args.targets) - {"prodrl-serve"} else ""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        exports = dense_exports(root, 2, *policy)
        common = {"num_top_logprobs": 8, "max_tokens": 8, "probe_prompts": 4, "export_scheme": "bf16",
                  "vllm_python": py, "server_args": SERVER_ARGS}
        if "prodrl-serve" in args.targets:
            rows.append(measure("prodrl-serve", Settings(home=str(root / "a"), deploy={
                **common, "target": "prodrl-serve", "target_port": pick_port_range(2), "server_args": ()}), exports))
        if "vllm-restart" in args.targets:
            rows.append(measure("vllm-restart", Settings(home=str(root / "b"), deploy={
                **common, "target": "vllm-restart", "target_port": pick_port_range(2)}), exports))
        if "vllm-reload" in args.targets:
            rows.append(measure_reload(root, common, exports, py))
    print("\n".join(row for row, _ in rows))
    print("deploy_switch: " + "; ".join(part for _, part in rows))


def measure_reload(root: Path, common: dict, exports: list[Path], py: str) -> tuple[str, str]:
    """``vllm-reload`` on a dev-mode vLLM this bench starts (and stops)."""
    port = pick_port()
    env = {**vllm_serve_env(), "VLLM_SERVER_DEV_MODE": "1"}
    with open(root / "dev.log", "wb") as log:
        dev = subprocess.Popen(vllm_serve_command(exports[0], port, 20, served_model_name="live", python=py,
                                                  extra_args=SERVER_ARGS),
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 300, expect_model="live", alive=lambda: dev.poll() is None)
        return measure("vllm-reload", Settings(home=str(root / "c"), deploy={
            **common, "target": "vllm-reload", "target_endpoint": f"http://127.0.0.1:{port}"}), exports)
    finally:
        stop_process_group(dev.pid)


if __name__ == "__main__":
    main()
