"""FSDP2 training (2 gloo ranks on CPU, launched by torchrun through Dagster Pipes) gives the same
weights and Adam state as the single-process run on the same data; a rank killed mid-round resumes
from the sharded checkpoint with identical results; a round trained at world size 2 continues at 1,
and one process's Adam state continues sharded; an MoE policy replaying recorded routing trains
at two ranks exactly as one process, its pi_k pass's extra diagnostic forward in step on every rank."""

import json
import os
import socket
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from dagster import materialize
from safetensors.torch import load_file

from prodrl_pipelines.loop import bootstrap
from prodrl_pipelines.config import environment
from prodrl_pipelines.loop import train
from prodrl_pipelines.config.environment import KILL_RANK_AT_STEP
from prodrl_pipelines.deploy_targets.processes import pick_port
from prodrl_pipelines.ops.training import torchrun_command
from prodrl_pipelines.rl.checkpoint import load_policy, load_trainer_state
from prodrl_pipelines.rl.trainer import build_optimizer
from prodrl_pipelines.assets.round import recorded_trajectories, trained_checkpoint, training_batch
from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import make_resources, open_services
from prodrl_pipelines.storage import documents

TINY = {"lab_size": "tiny", "lab_sft_steps": 5, "steps_per_round": 2, "batch_size": 4, "heldout_size": 4,
        "max_tokens": 6, "learning_rate": 1e-2, "correction": "tis", "kl_beta": 0.1,
        "max_tokens_per_microbatch": 40}  # several micro-batches per rank: accumulation, balancing, fillers


def _round_with_data(tmp_path, pg_instance, **extra):
    res = make_resources({**TINY, "home": str(tmp_path / "home"), "train_processes": 2, **extra})
    svc = open_services(res["settings"], res["store"])
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
    return res, svc, key


def trainer_gauges(port: int) -> dict[str, float]:
    """The trainer's /metrics (observability.trainer_metrics): name -> value (``..._info`` keyed by round)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {(f"{s.name}{{round={s.labels['round']}}}" if "round" in s.labels else s.name): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _gauges_followed_the_steps(seen: list, t0: float, key: str) -> None:
    """Scraped from the step callback (after the exporter took the step): each step's values."""
    taken = [x for x in seen if not x[1].get("skipped")]
    assert len(taken) >= 1
    for n, (step, metrics, g, at) in enumerate(taken, start=1):
        assert g["prodrl_trainer_round_step"] == n and g["prodrl_trainer_step"] == step
        assert g["prodrl_trainer_loss"] == pytest.approx(metrics["loss"])
        assert g["prodrl_trainer_tokens_per_second"] == pytest.approx(metrics["tokens_per_s"])
        assert g["prodrl_trainer_engine_mismatch"] == pytest.approx(metrics["engine_mismatch"])
        assert t0 <= g["prodrl_trainer_last_step_timestamp_seconds"] <= at
        assert g[f"prodrl_trainer_info{{round={key}}}"] == 1


def _same_weights(a_dir, b_dir, atol=2e-5, rtol=1e-4):
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


def test_two_rank_torchrun_matches_single_process(tmp_path, pg_instance):
    # rank 0 serves the trainer's Prometheus gauges while it trains (both runs; scraped in the first)
    port = pick_port()
    res, svc, key = _round_with_data(tmp_path, pg_instance, observability_trainer_metrics_port=port)
    t0, seen = time.time(), []
    single = train.train(svc, key, progress=False, out_dir=tmp_path / "single",
                         on_step=lambda step, m: seen.append((step, m, trainer_gauges(port), time.time())))
    assert single["steps_taken"] == 2
    _gauges_followed_the_steps(seen, t0, key)
    with pytest.raises(httpx.ConnectError):  # the round is trained: nothing serves its gauges any more
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)

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

    # the Adam state, gathered whole from the shards, is the single process's, keyed the same way
    sa, sb = load_trainer_state(tmp_path / "single"), load_trainer_state(svc.settings.checkpoints_root / key)
    assert sa.optimizer["param_groups"][0]["params"] == sb.optimizer["param_groups"][0]["params"]
    assert sa.optimizer["state"].keys() == sb.optimizer["state"].keys()
    for i, st in sa.optimizer["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[k], sb.optimizer["state"][i][k], atol=1e-6, rtol=1e-4)
    # ... so a round trained at world size 2 continues at world size 1: its state loads and steps
    model, _ = load_policy(svc.settings.checkpoints_root / key, dtype=torch.float32)
    opt = build_optimizer(model, svc.settings.recipe, sb)
    assert all(opt.state[p]["exp_avg"].shape == p.shape for p in model.parameters())
    opt.step()


@pytest.mark.long(seconds=60)
def test_a_lora_round_at_two_ranks_matches_one_process(tmp_path, pg_instance):
    """``training: lora`` under FSDP2: the adapters are sharded with their layers, the frozen base with
    them, and rank 0 saves from a whole copy that the gathered state is loaded into: the merged weights,
    the adapter and the adapters' Adam state equal the single process's."""
    res, svc, key = _round_with_data(tmp_path, pg_instance, training="lora", lora_rank=2)
    single = train.train(svc, key, progress=False, out_dir=tmp_path / "single")
    assert single["steps_taken"] == 2
    out = materialize([recorded_trajectories, training_batch, trained_checkpoint], selection=[trained_checkpoint],
                      instance=pg_instance, partition_key=key, resources=res)
    assert out.success
    assert out.asset_materializations_for_node("trained_checkpoint")[0].metadata["train_processes"].value == 2
    sharded = svc.settings.checkpoints_root / key
    _same_weights(tmp_path / "single", sharded)
    a = load_file(tmp_path / "single" / "adapter" / "adapter_model.safetensors")
    b = load_file(sharded / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)  # it trained
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)
    sa, sb = load_trainer_state(tmp_path / "single"), load_trainer_state(sharded)
    assert sa.optimizer["param_groups"][0]["params"] == sb.optimizer["param_groups"][0]["params"] == list(range(len(a)))
    for i, st in sa.optimizer["state"].items():
        torch.testing.assert_close(st["exp_avg_sq"], sb.optimizer["state"][i]["exp_avg_sq"], atol=1e-8, rtol=1e-4)


@pytest.mark.long(seconds=90)
def test_a_rank_killed_mid_round_resumes_from_the_sharded_checkpoint(tmp_path, pg_instance):
    res, svc, key = _round_with_data(tmp_path, pg_instance, steps_per_round=4, batch_size=2, checkpoint_every=1,
                                     activation_checkpointing=True)  # and layers recomputed under FSDP2
    store = res["store"]
    env = {**os.environ, **environment.write(settings=res["settings"].fields(),
                                             store={k: getattr(store, k) for k in type(store).model_fields}),
           "PYTHONUNBUFFERED": "1"}

    def torchrun(out, **extra):
        return subprocess.run(torchrun_command(key, 2) + ["--out", str(out)], env={**env, **extra},
                              capture_output=True, text=True, timeout=600)

    whole = torchrun(tmp_path / "uninterrupted")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert json.loads(whole.stdout.strip().splitlines()[-1])["resumed_from_step"] == 0
    in_round = svc.settings.checkpoints_root / ".in-round" / f"{key}-fsdp2"
    assert not in_round.exists()  # removed once the round's checkpoint was written
    killed = torchrun(tmp_path / "resumed", **{KILL_RANK_AT_STEP: "3"})
    assert killed.returncode != 0 and not (tmp_path / "resumed").exists()
    # each rank wrote its part into a directory of its own; the store holds the whole state
    assert {p.relative_to(in_round).as_posix() for p in in_round.glob("rank*/meta-rank*.pt")} == {
        "rank0/meta-rank0.pt", "rank1/meta-rank1.pt"}
    stored = documents.get_json(svc.blobs, f"in-round/{key}-fsdp2/latest.json")["files"]
    assert {"meta-rank0.pt", "meta-rank1.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(stored), stored
    resumed = torchrun(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    stats = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert stats["resumed_from_step"] == 2 and stats["steps_taken"] == 4  # the checkpoint before step 3
    assert load_trainer_state(tmp_path / "resumed").global_step == 4
    _same_weights(tmp_path / "uninterrupted", tmp_path / "resumed", atol=0, rtol=0)  # identical


def test_the_gpu_check_script_runs_and_says_so_without_a_gpu(tmp_path):
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_train_check.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "1", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no GPU here" in out.stdout and "FSDP2, 1 rank" in out.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["cuda"] is False and r["train"]["tokens_per_s"] > 0 and r["logprobs"]["time_ratio"] > 0
    assert "tool-agent shape" in out.stdout and r["shape"]["computed/unique"] <= 1.05


ROUND_TRIP = r'''
import sys, torch, torch.distributed as dist
from transformers import Qwen3MoeForCausalLM
from prodrl_pipelines.lab.model import lab_model_config
from prodrl_pipelines.rl import sharding
dist.init_process_group("gloo")
saved = torch.load(sys.argv[1], weights_only=False)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(lab_model_config("tiny", vocab_size=64))
model.load_state_dict(saved["model"])
root = sharding.shard_policy(model, dist.get_world_size())
opt = torch.optim.AdamW(root.parameters(), lr=1e-3)
sharding.load_full_optimizer_state(root, opt, saved["optimizer"])
for p in root.parameters():  # the same gradient as the single process's second step
    p.grad = torch.distributed.tensor.distribute_tensor(torch.ones(p.shape), p.device_mesh, p.placements)
opt.step()
full, osd = sharding.full_model_state(root), sharding.full_optimizer_state(root, opt)
if dist.get_rank() == 0:
    torch.save({"model": full, "optimizer": osd}, sys.argv[2])
dist.destroy_process_group()
'''


def test_a_single_process_adam_state_continues_sharded(tmp_path):
    """The whole, index-keyed Adam state one process saves loads into the sharded optimizer (world
    size 2) and its next step is the single process's next step, weights and moments."""
    import sys

    from transformers import Qwen3MoeForCausalLM

    from prodrl_pipelines.lab.model import lab_model_config

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(lab_model_config("tiny", vocab_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn(p.shape)
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "one.pt")
    for p in model.parameters():
        p.grad = torch.ones(p.shape)
    opt.step()  # the reference second step
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", port, str(script), str(tmp_path / "one.pt"),
                          str(tmp_path / "two.pt")], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr[-3000:]
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    ref = model.state_dict()
    assert two["model"].keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(two["model"][k], ref[k], atol=1e-6, rtol=1e-5, msg=k)
    want = opt.state_dict()
    assert two["optimizer"]["param_groups"][0]["params"] == want["param_groups"][0]["params"]
    for i, st in want["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(two["optimizer"]["state"][i][k], st[k], atol=1e-6, rtol=1e-5)


MOE_ROUND = r'''
import datetime, sys, torch, torch.distributed as dist
from transformers import Qwen3MoeForCausalLM
from prodrl_pipelines.rl import round_diagnostics, sharding
from prodrl_pipelines.rl.checkpoint import TrainerState
from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rl.trainer import build_optimizer, train_round
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))  # out of step: fail, not hang (a loaded machine may lag a rank long)
job = torch.load(sys.argv[1], weights_only=False)
model = Qwen3MoeForCausalLM(job["config"])
model.load_state_dict(job["model"])
root = sharding.shard_policy(model, dist.get_world_size())
recipe, state = Recipe(**job["recipe"]), TrainerState()
res = train_round(root, build_optimizer(root, recipe, state), job["trajs"], job["adv"], job["plan"], recipe, state,
                  pad_id=0, round_seed=0, progress=False, rank=dist.get_rank(), world_size=dist.get_world_size())
full = sharding.full_model_state(root)
# a sample smaller than the round: the ranks stop sampling together, whatever each one's own share
round_diagnostics.ROUTING_DIAGNOSTIC_TOKENS = 6
state = TrainerState()
small = train_round(root, build_optimizer(root, recipe, state), job["trajs"], job["adv"], job["plan"], recipe, state,
                    pad_id=0, round_seed=0, progress=False, rank=dist.get_rank(), world_size=dist.get_world_size())
if dist.get_rank() == 0:
    torch.save({"model": full, "routing": res.routing, "mismatch": res.mismatch_abs_logp,
                "small_sample": small.routing}, sys.argv[2])
dist.destroy_process_group()
'''


def _moe_round_with_recorded_routing():
    """A tiny MoE policy, eight one-call trajectories sampled by it with their routing recorded (every
    other one as a deployment routing differently would: replay changes the forward), and a layout in
    which one rank has a routed micro-batch where the other has a filler."""
    from transformers import Qwen3MoeForCausalLM

    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.engines.types import SamplingParams
    from prodrl_pipelines.lab.model import lab_model_config
    from prodrl_pipelines.rl.routing_replay import moe_shape
    from prodrl_pipelines.rl.trajectory import Call, Trajectory

    torch.manual_seed(0)
    config = lab_model_config("tiny", vocab_size=64)
    model = Qwen3MoeForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (24, 20, 18, 4, 5, 3, 4, 2)]
    recs = LocalEngine(model, None).generate(
        prompts, SamplingParams(max_tokens=4, num_top_logprobs=4, record_routing=True), seed=1)
    experts = moe_shape(model)[2]
    trajs = []
    for i, r in enumerate(recs):
        routing = r.routed_experts.astype(np.int64)
        routing = (routing + i % 2) % experts  # a bijection of expert ids: the sets stay distinct
        trajs.append(Trajectory(f"t{i}", "", "v0", float(i % 3), [Call(
            r.prompt_token_ids, r.output_token_ids, r.output_logprobs, 1.0, r.top_token_ids, r.top_logprobs,
            r.support_complete, routing=routing)]))
    recipe = {"steps_per_round": 2, "batch_size": 4, "routing_replay": "recorded", "correction": "tis",
              "kl_beta": 0.1, "learning_rate": 1e-2, "max_tokens_per_microbatch": 30}
    job = {"config": config, "model": {k: v.clone() for k, v in model.state_dict().items()}, "trajs": trajs,
           "adv": np.array([1.0, -1.0, 0.5, -0.5, 1.0, -0.5, 0.25, -1.0]), "plan": [[0, 1, 3, 5], [2, 4, 6, 7]],
           "recipe": recipe}
    return job


def test_moe_with_recorded_routing_trains_at_two_ranks_as_one_process(tmp_path):
    """The pi_k pass's with/without-replay diagnostic forward runs on every rank or on none (a forward
    on one rank only leaves the ranks' parameter all-gathers out of step); the round's weights and
    its routing diagnostics, gathered over the ranks, are the single process's."""
    import signal
    import sys

    from transformers import Qwen3MoeForCausalLM

    from prodrl_pipelines.rl.checkpoint import TrainerState
    from prodrl_pipelines.rl.config import Recipe
    from prodrl_pipelines.rl.trainer import build_optimizer, layout_round, train_round

    job = _moe_round_with_recorded_routing()
    recipe = Recipe(**job["recipe"])
    # the case that matters: at some micro-batch one rank has routed work and the other a filler
    ranks = [layout_round(job["trajs"], job["adv"], job["plan"], recipe, r, 2)[0] for r in range(2)]
    assert any(bool(a) != bool(b) for s in range(2) for a, b in zip(ranks[0][s][1], ranks[1][s][1]))

    model = Qwen3MoeForCausalLM(job["config"])
    model.load_state_dict(job["model"])
    state = TrainerState()
    single = train_round(model, build_optimizer(model, recipe, state), job["trajs"], job["adv"], job["plan"], recipe,
                         state, pad_id=0, round_seed=0, progress=False)
    assert single.routing["routing_disagreement"] > 0.1 and single.routing["routing_diagnostic_tokens"] > 0

    torch.save(job, tmp_path / "job.pt")
    (tmp_path / "moe_round.py").write_text(MOE_ROUND)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                             "--master_addr", "127.0.0.1", "--master_port", port, str(tmp_path / "moe_round.py"),
                             str(tmp_path / "job.pt"), str(tmp_path / "two.pt")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                                 "OMP_NUM_THREADS": "1"})
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:  # a hang past gloo's own timeout: end the whole group
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail("the two-rank MoE round hung:\n" + log[-3000:])
    assert proc.returncode == 0, log[-3000:]
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    ref = model.state_dict()
    assert two["model"].keys() == ref.keys()
    moved = 0
    for k in ref:
        torch.testing.assert_close(two["model"][k], ref[k], atol=2e-5, rtol=1e-4, msg=k)
        moved += not torch.equal(ref[k], job["model"][k])
    assert moved > 0
    assert two["mismatch"] == pytest.approx(single.mismatch_abs_logp, rel=1e-4)
    assert two["routing"].keys() == single.routing.keys()
    for k, v in single.routing.items():
        assert two["routing"][k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), k
    sampled = two["small_sample"]["routing_diagnostic_tokens"]
    assert 6 <= sampled < single.routing["routing_diagnostic_tokens"]  # stopped once the ranks had 6 between them
