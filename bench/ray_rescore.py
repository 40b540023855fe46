"""Re-scoring with a judge on a Ray Data actor pool, 2 workers vs 1: the wall time of one rescore job.

A local two-node Ray cluster (``cluster.local``, ``--cpus`` per node), a store of ``--rows`` one-call
trajectories each with a reward row of an older judge version, and a local OpenAI-compatible judge
that answers every request after ``--delay`` seconds (I/O-bound, as a production judge is). Each
measurement re-scores a fresh copy of the store with ``rewards.scoring.rescore`` on the ``ray``
runner (``--concurrency`` judge requests in flight per actor), start to commit: reading the store,
the actor pool's start, scoring, and the one commit; the two pool sizes alternate for ``--repeats``
rounds and the ratio is of the medians. The rows both sizes write are checked identical.

Last line: ``ray_rescore: rows=N; rescore 2 workers/1=X`` (goal <= 0.6). ``measure(...)`` returns X
for ``bench/ray_scale.py``; with a Ray connection already open it uses that cluster.

Usage: ``python bench/ray_rescore.py [--rows 1000] [--delay 0.05] [--concurrency 4] [--repeats 2] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): one node of 2 CPUs, 8 rows, a 10 ms judge, one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _smoke import parse_args  # noqa: E402

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
# measure()'s smoke size
SMOKE = dict(rows=8, delay=0.01, concurrency=2, repeats=1)


class DelayedJudge(BaseHTTPRequestHandler):
    """A judge that answers after ``delay`` seconds: 1 for an even task, else 0."""

    delay = 0.05

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.delay)
        digit = body["messages"][0]["content"].rstrip()[-1:]
        score = 1.0 if digit.isdigit() and int(digit) % 2 == 0 else 0.0
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": f'{{"score": {score}}}'}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _store(root: Path, rows: int):
    """``rows`` one-call trajectories, each with a reward of an older judge version."""
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.store import TrajectoryStore

    store = TrajectoryStore(LocalBlobStore(root))
    call = {"call_index": 0, "policy_version": "v0", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5],
            "output_logprobs": [-0.5, -0.25], "top_token_ids": [[4, 6], [5, 7]],
            "top_logprobs": [[-0.5, -1.0], [-0.25, -2.0]], "support_complete": False, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "prompt_text": "What is 2+2? ", "created_at": T0}
    store.write_calls([{**call, "trajectory_id": f"t{i:06d}", "task_id": f"task-{i}", "output_text": f"answer {i}"}
                       for i in range(rows)])
    store.write_rewards([{"trajectory_id": f"t{i:06d}", "reward": 0.5, "source": "judge", "version": "judge@old",
                          "created_at": T0 + timedelta(minutes=1)} for i in range(rows)])
    return store


def _rescored(store, version: str) -> list:
    t = store.read_rewards(latest=False)
    return sorted((a, r) for a, r, v in zip(t["trajectory_id"].to_pylist(), t["reward"].to_pylist(),
                                            t["version"].to_pylist()) if v == version)


def measure(rows: int = 1000, delay: float = 0.05, concurrency: int = 4, repeats: int = 2,
            cpus_per_node: float = 2, root: Path | None = None, log=print, nodes: int = 2) -> float:
    """Median wall time of a judge rescore job on 2 Ray Data workers over that on 1 (same rows checked);
    without a Ray connection, on a local cluster of ``nodes`` it starts (and stops)."""
    from prodrl_pipelines.cluster.local import LOOPBACK_ENV, LocalRayCluster

    os.environ.update(LOOPBACK_ENV)  # before Ray is imported: it reads the loopback switch once
    import ray

    from prodrl_pipelines.rewards.config import RewardSettings
    from prodrl_pipelines.rewards.runners import Runner
    from prodrl_pipelines.rewards.scoring import RewardPlan, rescore
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.store import TrajectoryStore

    root = Path(root or tempfile.mkdtemp(prefix="ray-rescore-bench-"))
    template = _store(root / "template", rows)
    DelayedJudge.delay = delay
    server = ThreadingHTTPServer(("127.0.0.1", 0), DelayedJudge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rs = RewardSettings(sources=("judge",), judge_endpoint=f"http://127.0.0.1:{server.server_address[1]}/v1",
                        judge_model="judge", judge_concurrency=concurrency, judge_retries=0, judge_timeout_s=60,
                        judge_rubric="Grade: {transcript}")
    plan = RewardPlan(rs)
    cluster = None
    own = not ray.is_initialized()
    if own:
        cluster = LocalRayCluster(root / "ray", nodes=nodes, cpus_per_node=cpus_per_node).start()
        ray.init(address="127.0.0.1:" + cluster.gcs_address.rpartition(":")[2], log_to_driver=False,  # GCS on loopback
                 runtime_env={"env_vars": dict(LOOPBACK_ENV)})
    times: dict[int, list[float]] = {1: [], 2: []}
    written: dict[int, list] = {}
    try:
        for r in range(repeats):
            for n in (1, 2):
                copy = root / f"run-{r}-{n}"
                shutil.copytree(template.blobs.root, copy)
                store = TrajectoryStore(LocalBlobStore(copy))
                t0 = time.perf_counter()
                rep = rescore(store, plan, "judge", runner=Runner("ray", n))
                times[n].append(time.perf_counter() - t0)
                if rep.scored != rows:
                    raise AssertionError(f"{n} worker(s) scored {rep.scored} of {rows}: {rep.first_error}")
                written.setdefault(n, _rescored(store, plan.current_version("judge")))
                shutil.rmtree(copy)
        if written[1] != written[2]:
            raise AssertionError("2 Ray Data workers wrote other rows than 1")
        for n in (1, 2):
            log(f"{n} worker(s), {concurrency} judge requests in flight each, {delay * 1000:.0f} ms per answer: "
                + ", ".join(f"{t:.2f}" for t in times[n]) + " s")
        return statistics.median(times[2]) / statistics.median(times[1])
    finally:
        server.shutdown()
        server.server_close()
        if own:
            ray.shutdown()
            cluster.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--delay", type=float, default=0.05, help="seconds the judge takes per answer")
    ap.add_argument("--concurrency", type=int, default=4, help="judge requests in flight per actor")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cpus", type=float, default=2, help="CPUs per Ray node")
    ap.add_argument("--nodes", type=int, default=2, help="of the local Ray cluster")
    a = parse_args(ap, argv, **SMOKE, nodes=1, cpus=2)
    x = measure(a.rows, a.delay, a.concurrency, a.repeats, a.cpus, nodes=a.nodes)
    print(f"ray_rescore: rows={a.rows}; rescore 2 workers/1={x:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
