"""torch.distributed training (2 gloo ranks on CPU, launched by torchrun through Dagster Pipes)
gives the same weights as the single-process run on the same data."""

from datetime import datetime, timezone

import numpy as np
import torch
from dagster import materialize
from safetensors.torch import load_file

from prodrl_pipelines import bootstrap
from prodrl_pipelines import rounds
from prodrl_pipelines.assets.round import recorded_trajectories, trained_checkpoint, training_batch
from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import make_resources, services

TINY = {"lab_size": "tiny", "lab_sft_steps": 5, "steps_per_round": 2, "batch_size": 4, "heldout_size": 4,
        "max_tokens": 6, "learning_rate": 1e-2, "correction": "tis", "kl_beta": 0.1}


def test_two_rank_torchrun_matches_single_process(tmp_path, pg_instance):
    res = make_resources({**TINY, "home": str(tmp_path / "home"), "train_processes": 2})
    svc = services(res["settings"], res["store"])
    bootstrap.bootstrap_base_policy(svc, progress=False)
    simulate_traffic(svc, 8)
    # graded rewards so every step has signal (the tiny model solves nothing)
    ids = sorted(set(svc.store.read_calls()["trajectory_id"].to_pylist()))
    rng = np.random.default_rng(0)
    svc.store.write_rewards([{"trajectory_id": t, "reward": float(rng.random()), "source": "test",
                              "created_at": datetime.now(timezone.utc)} for t in ids])
    key = "round-000001"
    pg_instance.add_dynamic_partitions("rounds", [key])
    assert materialize([recorded_trajectories, training_batch], instance=pg_instance, partition_key=key,
                       resources=res).success
    single = rounds.train(svc, key, progress=False, out_dir=tmp_path / "single")
    assert single["steps_taken"] == 2

    out = materialize([recorded_trajectories, training_batch, trained_checkpoint], selection=[trained_checkpoint],
                      instance=pg_instance, partition_key=key, resources=res)
    assert out.success
    md = out.asset_materializations_for_node("trained_checkpoint")[0].metadata
    assert md["train_processes"].value == 2 and md["steps_taken"].value == 2

    a = load_file(tmp_path / "single" / "model.safetensors")
    b = load_file(svc.settings.checkpoints_root / key / "model.safetensors")
    base = load_file(svc.settings.checkpoints_root / "round-000000" / "model.safetensors")
    moved = 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)
        moved += not torch.equal(a[name], base[name])
    assert moved > 0  # training changed the weights, so the comparison means something
