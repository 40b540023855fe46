"""Held-out evaluation on 2 Ray workers vs 1: the wall time of one suite's episodes, side by side.

A local two-node Ray cluster (``cluster.local``, two CPUs per node unless ``--cpus``: both pools
stay up), the lab's demo policy (built once, a short warm start), the lab suite's first ``--tasks``
held-out tasks in batches of ``--batch`` (``eval.episode_batch``). Two warm actor pools (``evaluation.ray_runner``), one of 1
worker and one of 2, each worker with one torch thread: the pools are started and every worker has
loaded the engine before anything is timed, and each pool plays the suite once untimed, so worker
start-up (process, imports, engine load) is counted in neither; a round's evaluation job pays it
once per job. Then ``--repeats`` rounds alternate 1 worker, 2 workers, and the ratio is of the
medians. The two pools' episodes are checked identical (and equal to the in-process evaluation).

Last line: ``ray_eval: tasks=N; eval 2 workers/1=X`` (goal <= 0.65). ``measure(...)`` returns X for
``bench/ray_scale.py``; with a Ray connection already open it uses that cluster.

Usage: ``python bench/ray_eval.py [--tasks 64] [--batch 8] [--repeats 3] [--max-tokens 12] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): one node of 3 CPUs, the tiny policy, 2 tasks of 2 tokens, one repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _smoke import parse_args  # noqa: E402


# measure()'s smoke size
SMOKE = dict(tasks=2, batch=1, repeats=1, max_tokens=2, size="tiny", sft_steps=2)


def _facts(eps) -> list:
    return [(e.trajectory_id, e.reward, [(c.record.output_token_ids, c.record.output_logprobs) for c in e.calls])
            for e in eps]


def _policy(root: Path, size: str, sft_steps: int) -> Path:
    from prodrl_pipelines.lab.warmstart import build_base_policy

    out = root / f"policy-{size}-{sft_steps}"
    if not (out / "config.json").exists():
        build_base_policy(out, size=size, sft_steps=sft_steps, progress=False)
    return out


def _work(policy: Path, tasks: int, batch: int, max_tokens: int, home: Path):
    from prodrl_pipelines.config.settings import settings_from_flat
    from prodrl_pipelines.evaluation import load_suite
    from prodrl_pipelines.evaluation.heldout import heldout_tasks
    from prodrl_pipelines.evaluation.runners import EpisodeWork

    s = settings_from_flat({"home": str(home), "heldout_size": tasks, "max_tokens": max_tokens,
                            "eval_episode_batch": batch})
    suite = load_suite("lab", "", s)
    return EpisodeWork(str(policy), "bench", suite, heldout_tasks(s, suite), s.deploy.sampling(),
                       s.eval.eval_seed, s.eval.episode_batch)


def measure(tasks: int = 64, batch: int = 8, repeats: int = 3, max_tokens: int = 12, size: str = "demo",
            sft_steps: int = 30, cpus_per_node: float = 2, root: Path | None = None, log=print, nodes: int = 2) -> float:
    """Median wall time of the suite on 2 warm Ray workers over that on 1 (same episodes checked); without
    a Ray connection, on a local cluster of ``nodes`` it starts (and stops)."""
    from prodrl_pipelines.cluster.local import LOOPBACK_ENV

    if "ray" not in sys.modules:
        os.environ.update(LOOPBACK_ENV)  # before Ray reads it at import: a local cluster stays on loopback
    import ray
    import torch

    from prodrl_pipelines.cluster.local import LocalRayCluster
    from prodrl_pipelines.evaluation.ray_runner import RayEpisodeRunner
    from prodrl_pipelines.evaluation.runners import InProcessRunner

    root = Path(root or tempfile.mkdtemp(prefix="ray-eval-bench-"))
    policy = _policy(root, size, sft_steps)
    work = _work(policy, tasks, batch, max_tokens, root / "home")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    reference = InProcessRunner().play(work)
    log(f"in-process (1 torch thread, cold engine): {time.perf_counter() - t0:.2f} s, "
        f"{len(work.batches())} batches of {batch}")
    cluster = None
    own = not ray.is_initialized()
    if own:
        cluster = LocalRayCluster(root / "ray", nodes=nodes, cpus_per_node=cpus_per_node).start()
        # the head's GCS listens on loopback; the address Ray reports may name the primary one
        ray.init(address="127.0.0.1:" + cluster.gcs_address.rpartition(":")[2], log_to_driver=False)
    pools = {1: RayEpisodeRunner(workers=1, cpus_per_worker=1), 2: RayEpisodeRunner(workers=2, cpus_per_worker=1)}
    try:
        for n, pool in pools.items():
            t0 = time.perf_counter()
            pool.prepare(str(policy))
            log(f"{n} worker(s): started and loaded in {time.perf_counter() - t0:.2f} s (not counted)")
            if _facts(pool.play(work)) != _facts(reference):  # warm-up play, untimed
                raise AssertionError(f"{n} Ray worker(s) played other episodes than in-process")
        times: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(repeats):
            for n, pool in pools.items():
                t0 = time.perf_counter()
                pool.play(work)
                times[n].append(time.perf_counter() - t0)
        for n in pools:
            log(f"{n} worker(s): " + ", ".join(f"{t:.2f}" for t in times[n]) + " s")
        return statistics.median(times[2]) / statistics.median(times[1])
    finally:
        for pool in pools.values():
            pool.close()
        if own:
            ray.shutdown()
            cluster.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="episodes per batch (eval.episode_batch)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--size", default="demo", help="lab policy size")
    ap.add_argument("--cpus", type=float, default=2, help="CPUs per Ray node (both pools stay up: 3 workers)")
    ap.add_argument("--nodes", type=int, default=2, help="of the local Ray cluster")
    ap.add_argument("--sft-steps", type=int, default=30, help="the policy's warm start")
    a = parse_args(ap, argv, **SMOKE, nodes=1, cpus=3)
    x = measure(a.tasks, a.batch, a.repeats, a.max_tokens, a.size, a.sft_steps, a.cpus, nodes=a.nodes)
    print(f"ray_eval: tasks={a.tasks}; eval 2 workers/1={x:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
