"""A round's heavy steps on a local two-node Ray cluster against their single-host paths, side by side.

1. **Training**: the same round trained through Dagster twice, from the same live checkpoint and
   data: ``torchrun`` with 2 processes (``train_processes: 2``), then Ray Train with 2 workers, one per
   node (``cluster: ray``). The step time of each optimizer step is its tokens over its tokens/s (the
   trainer's own timing, so job start-up is in neither); the ratio is of the medians (goal <= 1.15).
2. **Evaluation**: ``bench/ray_eval.py``'s measure: one suite on 2 warm Ray workers vs 1, one torch
   thread each (goal <= 0.65).
3. **Re-scoring**: ``bench/ray_rescore.py``'s measure: a judge answering after a fixed delay, a
   Ray Data pool of 2 workers vs 1 (goal <= 0.6).

One cluster (two nodes, ``--cpus`` each) serves all three. Last line:
``ray_scale: nodes=N; train step ray/torchrun=X; eval 2 workers/1=X; rescore 2 workers/1=X``

Usage: ``python bench/ray_scale.py [--cpus 2] [--steps 6] [--nodes 2] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): one node of 3 CPUs (training placed anywhere, not one rank per
node), one optimizer step; evaluation and re-scoring not run (``eval 2 workers/1=smoke``): their own
benches' smoke runs measure them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _smoke import parse_args  # noqa: E402

# a lab round big enough for a step to be more than start-up noise, small enough for 2 shared cores
ROUND = {"lab_size": "tiny", "lab_sft_steps": 5, "steps_per_round": 6, "batch_size": 8, "heldout_size": 4,
         "max_tokens": 8, "learning_rate": 1e-3, "max_tokens_per_microbatch": 256}


def _step_seconds(svc, rkey: str) -> list[float]:
    from prodrl_pipelines.storage import documents, keys

    steps = [m for m in documents.get_json(svc.blobs, keys.train_steps(rkey)) if not m.get("skipped")]
    return [m["tokens"] / m["tokens_per_s"] for m in steps]


def train_ratio(cluster, root: Path, steps: int, log=print, placement: str = "spread") -> float:
    import numpy as np
    from dagster import DagsterInstance, materialize

    from prodrl_pipelines.assets.round import recorded_trajectories, trained_checkpoint, training_batch
    from prodrl_pipelines.lab.traffic import simulate_traffic
    from prodrl_pipelines.loop import bootstrap
    from prodrl_pipelines.resources.settings import make_resources, open_services

    base = {**ROUND, "steps_per_round": steps, "home": str(root / "home")}
    res = make_resources({**base, "train_processes": 2})
    svc = open_services(res["settings"], res["store"])
    bootstrap.bootstrap_base_policy(svc, progress=False)
    simulate_traffic(svc, 4 * steps * ROUND["batch_size"])
    ids = sorted(set(svc.store.read_calls()["trajectory_id"].to_pylist()))
    rng = np.random.default_rng(0)
    svc.store.write_rewards([{"trajectory_id": t, "reward": float(rng.random()), "source": "bench",
                              "created_at": datetime.now(timezone.utc)} for t in ids])
    rkey = "round-000001"
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("rounds", [rkey])
        assets = [recorded_trajectories, training_batch, trained_checkpoint]
        assert materialize(assets[:2], instance=instance, partition_key=rkey, resources=res).success
        times = {}
        for name, extra in (("torchrun", {}), ("ray", {"train_processes": 1, "cluster": "ray",
                                                       "cluster_address": cluster.dashboard_url,
                                                       "cluster_workers": 2, "cluster_placement": placement})):
            r = make_resources({**base, "train_processes": 2, **extra})
            assert materialize(assets, selection=[trained_checkpoint], instance=instance, partition_key=rkey,
                               resources=r).success, name
            times[name] = _step_seconds(svc, rkey)
            log(f"  train {name}: step seconds {[round(t, 3) for t in times[name]]}")
    return statistics.median(times["ray"]) / statistics.median(times["torchrun"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", type=float, default=2, help="CPUs each of the two nodes offers")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps of the trained round")
    ap.add_argument("--nodes", type=int, default=2, help="of the local Ray cluster (1: training placed anywhere)")
    a = parse_args(ap, argv, steps=1, nodes=1, cpus=3)
    from prodrl_pipelines.cluster.local import LOOPBACK_ENV

    os.environ.update(LOOPBACK_ENV)  # before Ray is imported anywhere
    import ray

    import ray_eval
    import ray_rescore
    from prodrl_pipelines.cluster.local import LocalRayCluster

    with tempfile.TemporaryDirectory(prefix="ray-scale-") as tmp:
        root = Path(tmp)
        with LocalRayCluster(root / "cluster", nodes=a.nodes, cpus_per_node=a.cpus) as cluster:
            train = train_ratio(cluster, root / "train", a.steps, placement="spread" if a.nodes > 1 else "any")
            if a.smoke:  # bench/ray_eval.py and bench/ray_rescore.py --smoke run these measures themselves
                ev = rs = "smoke"
            else:
                ray.init(address=cluster.gcs_address, log_to_driver=False)
                try:
                    ev = f"{ray_eval.measure(cpus_per_node=a.cpus, root=root / 'eval'):.2f}"
                    rs = f"{ray_rescore.measure(cpus_per_node=a.cpus, root=root / 'rescore'):.2f}"
                finally:
                    ray.shutdown()
    print(f"ray_scale: nodes={a.nodes}; train step ray/torchrun={train:.2f}; eval 2 workers/1={ev}; "
          f"rescore 2 workers/1={rs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
