"""LoRA policies on the trainer (``rl.lora``): a step moves only the adapters, by the closed form of
Adam's first step on their gradients; the base with the adapter off is the base; the adapter saved in
PEFT's format loads back to the same policy."""

import copy
import json

import numpy as np
import pytest
import torch

from prodrl_pipelines.config.settings import settings_from_flat
from prodrl_pipelines.rl import lora
from prodrl_pipelines.rl.advantages import compute_advantages
from prodrl_pipelines.rl.batch import pack_minibatch
from prodrl_pipelines.rl.checkpoint import TrainerState
from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rl.logprobs import token_logprobs
from prodrl_pipelines.rl.trainer import build_optimizer, train_round
from tests.test_rl import _random_trajs, _tiny_model

LORA = dict(training="lora", lora_rank=2, lora_alpha=4.0, steps_per_round=1, batch_size=4, learning_rate=1e-3,
            grad_clip=1e9)  # no clipping: the closed form below is Adam's first step on the raw gradient


def _adapted_layers(model):
    return {name: mod for name, mod in model.named_modules() if hasattr(mod, "lora_A") and "default" in mod.lora_A}


def test_a_lora_step_is_adams_first_step_on_the_closed_form_gradient_and_the_base_is_untouched():
    """B = 0 at the start, so dL/dA = s B^T G = 0 and dL/dB = s G A^T (s = alpha / r, G = dL/dW of the
    base at the same weights): one Adam step leaves A as it was and moves B by -lr g / (|g| + eps)."""
    base = _tiny_model(seed=3).double()
    trajs = _random_trajs(4, seed=5)
    adv = compute_advantages([t.reward for t in trajs], "loo")
    recipe = Recipe(**LORA)

    # G: the same round's gradient on the base weights (a plain copy: full training, nothing applied)
    plain = copy.deepcopy(base)
    full = Recipe(**{**LORA, "training": "full", "learning_rate": 1e-30})
    opt = build_optimizer(plain, full, TrainerState())
    train_round(plain, opt, trajs, adv, [[0, 1, 2, 3]], full, TrainerState(), 0, 0, progress=False)
    grads = {n: p.grad.clone() for n, p in plain.named_parameters()}

    model = lora.with_adapter(copy.deepcopy(base), recipe)
    layers = _adapted_layers(model)
    assert {n.rsplit(".", 1)[-1] for n in layers} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"}  # all-linear: every linear layer but lm_head
    before = {n: (m.lora_A["default"].weight.detach().clone(), m.lora_B["default"].weight.detach().clone())
              for n, m in layers.items()}
    st = TrainerState()
    opt = build_optimizer(model, recipe, st)
    trainable = lora.trainable_parameters(model)
    assert len(trainable) == 2 * len(layers)  # the optimizer holds only A and B of each adapted layer
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in trainable}
    train_round(model, opt, trajs, adv, [[0, 1, 2, 3]], recipe, st, 0, 0, progress=False)
    assert set(opt.state) <= set(trainable)

    s = recipe.lora_alpha / recipe.lora_rank
    eps = opt.param_groups[0]["eps"]
    for name, m in layers.items():
        a0, b0 = before[name]
        assert torch.equal(b0, torch.zeros_like(b0))
        assert torch.equal(m.lora_A["default"].weight.detach(), a0)  # zero gradient: no move
        g = s * grads[name.removeprefix("base_model.model.") + ".weight"] @ a0.T
        expected = -recipe.learning_rate * g / (g.abs() + eps)
        torch.testing.assert_close(m.lora_B["default"].weight.detach(), expected, rtol=1e-9, atol=1e-15)
    merged = dict(model.named_parameters())
    for n, p in base.named_parameters():  # the base is bit-identical after the round
        key = f"base_model.model.{n}"
        key = key if key in merged else key.replace(".weight", ".base_layer.weight")
        assert torch.equal(merged[key].detach(), p.detach()), n


def test_the_policy_with_its_adapter_off_is_the_base_and_a_saved_adapter_loads_back(tmp_path):
    base = _tiny_model(seed=4)
    trajs = _random_trajs(4, seed=6)
    adv = compute_advantages([t.reward for t in trajs], "loo")
    recipe = Recipe(**{**LORA, "learning_rate": 1e-2, "grad_clip": 1.0})
    model = lora.with_adapter(copy.deepcopy(base), recipe)
    st = TrainerState()
    train_round(model, build_optimizer(model, recipe, st), trajs, adv, [[0, 1, 2, 3]], recipe, st, 0, 0,
                progress=False)
    b = pack_minibatch(trajs, np.ones(4), pad_id=0)
    with torch.no_grad():
        want = token_logprobs(base, b)
        adapted = token_logprobs(model, b)
        with lora.adapter_off(model):
            off = token_logprobs(model, b)
    assert not torch.allclose(adapted, want)  # the step changed the policy
    assert torch.equal(off, want)  # the reference policy: no second model loaded

    out = lora.save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (2, 4.0, "LORA")
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:  # the keys vLLM's loader expects
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert all(".lora_A." in k or ".lora_B." in k for k in keys)
    back = lora.with_adapter(copy.deepcopy(base), recipe, out)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(back, b), adapted, rtol=0, atol=0)


def test_lora_settings_are_checked_before_any_work():
    s = settings_from_flat({"training": "lora", "lora_rank": 4, "lora_target_modules": ["q_proj", "v_proj"]})
    assert (s.recipe.training, s.recipe.lora_rank, s.recipe.lora_target_modules) == ("lora", 4, ("q_proj", "v_proj"))
    assert Recipe().training == "full" and Recipe().lora_target_modules == ("all-linear",)
    with pytest.raises(ValueError, match="lora_target_modules.*fused parameters"):
        settings_from_flat({"training": "lora", "lora_target_modules": ["q_proj", "gate_up_proj"]})
    assert settings_from_flat({"training": "lora", "correction": "ref_is"}).recipe.correction == "ref_is"
    with pytest.raises(ValueError, match="lora_rank"):
        settings_from_flat({"training": "lora", "lora_rank": 0})


@pytest.mark.long(seconds=60)
def test_lora_rounds_through_dagster_adapt_the_frozen_base_and_carry_the_adapter(tmp_path, pg_instance):
    """``training: lora`` through the round job: round 1 trains a fresh adapter on the live (round 0)
    weights and its checkpoint holds the merged weights (what the export, evaluation and deploy read,
    as for a full round), the adapter in PEFT's format and the base's version; only adapted layers
    moved. Round 2 trains that adapter further on the same frozen base (round 0's weights), with the
    adapters' Adam state carried over.

    Deployed with ``prodrl-serve-lora``: bootstrap starts a server on the NVFP4 base export; round 1's
    adapter is loaded into that process (no restart), probed on base export + adapter, and its MLflow
    model version names the base it is served on."""
    from prodrl_pipelines.definitions import build_definitions
    from prodrl_pipelines.deploy_targets import make_target
    from prodrl_pipelines.deploy_targets.processes import pick_port_range
    from prodrl_pipelines.resources.settings import make_resources
    from prodrl_pipelines.resources.settings import open_services
    from tests.test_pipeline_e2e import TINY

    res = make_resources({**TINY, "home": str(tmp_path / "home"), "training": "lora", "lora_rank": 2,
                          "monitors_enabled": [],  # the feedback below is arbitrary: no behaviour gate on it
                          "learning_rate": 1e-2, "target": "prodrl-serve-lora", "target_port": pick_port_range(4)})
    defs = build_definitions(res)
    svc = open_services(res["settings"], res["store"], res["mlflow"])
    target = make_target(svc.settings)
    try:
        _lora_rounds(defs, res, svc, target, pg_instance)
    finally:
        target.stop()


def rewarded_traffic(svc, episodes: int = 8) -> None:
    """Lab traffic, then the client's feedback on it: the tiny policy earns 0 on every task, so the
    rewards alternate 0 and 1 (a signal to train on, arbitrary by design)."""
    from datetime import datetime, timezone

    from prodrl_pipelines.lab.traffic import simulate_traffic

    before = set(svc.store.read_calls(columns=[]).column("trajectory_id").to_pylist())
    simulate_traffic(svc, episodes)
    new = sorted(set(svc.store.read_calls(columns=[]).column("trajectory_id").to_pylist()) - before)
    svc.store.write_rewards([{"trajectory_id": t, "reward": float(i % 2), "source": "feedback",
                              "created_at": datetime.now(timezone.utc)} for i, t in enumerate(new)])


def _lora_rounds(defs, res, svc, target, pg_instance):
    from safetensors.torch import load_file

    from prodrl_pipelines.quant.adapter_export import adapter_export
    from prodrl_pipelines.rl.checkpoint import load_trainer_state
    from tests.test_pipeline_e2e import ROUND_ASSETS, request_round
    from dagster import materialize

    assert defs.resolve_job_def("bootstrap").execute_in_process(instance=pg_instance).success
    server = target.current()
    assert server.base_version == "round-000000" and server.adapters == []  # the NVFP4 base export serves

    def traffic():
        rewarded_traffic(svc)

    traffic()
    req = request_round(pg_instance, defs, res)
    out = defs.resolve_job_def("prod_rl_round").execute_in_process(instance=pg_instance, partition_key=req.partition_key,
                                                                tags=req.tags)
    assert out.success and svc.ledger.live().policy_version == "round-000001"
    root = svc.settings.checkpoints_root
    adapter, base_version = lora.adapter_of(root / "round-000001")
    assert base_version == "round-000000" and (adapter / "adapter_model.safetensors").exists()
    base, merged = load_file(root / "round-000000" / "model.safetensors"), load_file(root / "round-000001" / "model.safetensors")
    moved = {k for k in base if not torch.equal(base[k], merged[k])}
    assert moved and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                         for k in moved), moved  # the tiny MoE: attention only; norms, embeddings, experts frozen
    assert lora.adapter_of(root / "round-000000") == (None, None)
    # its export carries the adapter on the base export, and the running server loaded it: no restart
    exports = svc.settings.exports_root
    assert adapter_export(exports / "round-000001") == (exports / "round-000001" / "adapter", "round-000000",
                                                        (exports / "round-000000").resolve())
    r1 = svc.ledger.round_summary("round-000001")
    assert r1["mode"] == "adapter" and r1["probe_mean_abs"] < 0.05 and r1["adapter_bytes"] < r1["export_bytes"] / 4
    assert target.current().pid == server.pid and target.current().adapters == ["round-000001"]
    # the model version names the base export its adapter is served on
    tags = svc.lineage.version_tags(r1["model_version"])
    assert tags["lora_base_version"] == "round-000000" and tags["lora_adapter_bytes"] == str(r1["adapter_bytes"])
    assert tags["lora_base_model_version"] == svc.ledger.round_summary("round-000000")["model_version"]

    traffic()
    req = request_round(pg_instance, defs, res)
    assert materialize(ROUND_ASSETS[:3], instance=pg_instance, partition_key=req.partition_key, resources=res).success
    adapter2, base2 = lora.adapter_of(root / "round-000002")
    assert base2 == "round-000000"  # still the frozen base, not round 1's merged weights
    a1, a2 = load_file(adapter / "adapter_model.safetensors"), load_file(adapter2 / "adapter_model.safetensors")
    assert a1.keys() == a2.keys() and any(not torch.equal(a1[k], a2[k]) for k in a1)
    state = load_trainer_state(root / "round-000002")
    assert state.global_step == load_trainer_state(root / "round-000001").global_step + len(
        [s for s in json.loads(svc.blobs.get_bytes("rounds/round-000002/train_steps.json")) if not s.get("skipped")])
    assert len(state.optimizer["param_groups"][0]["params"]) == len(a1)  # Adam over the adapters only


def test_ref_is_and_the_evaluation_see_a_lora_round_as_it_was_served(tmp_path):
    """What served a LoRA round is recorded at export time: with an adapter target, the NVFP4 base export
    with the trained adapter folded in (not the merged export, quantized after the merge: quant(W) + s B A
    differs from quant(W + s B A)); with any other target, the export itself. ``ref_is``'s reference and
    the held-out evaluation's engine both use that form."""
    from safetensors.torch import load_file

    from prodrl_pipelines.evaluation.batches import load_engine
    from prodrl_pipelines.lab.adapters import random_adapter_exports
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.loop.train import served_weights
    from prodrl_pipelines.quant.export import export_policy
    from prodrl_pipelines.rl.checkpoint import load_policy

    ckpt = build_base_policy(tmp_path / "base-ckpt", size="tiny-dense", seed=0, sft_steps=2, progress=False)
    export_policy(ckpt, tmp_path / "base", "nvfp4-w4a16")
    as_adapter = random_adapter_exports(ckpt, tmp_path / "base", tmp_path / "a", {"v1": 0.05}, scheme="nvfp4-w4a16")["v1"]
    as_merged = random_adapter_exports(ckpt, tmp_path / "base", tmp_path / "m", {"v1": 0.05}, scheme="nvfp4-w4a16",
                                       served_as="merged")["v1"]
    served, merged = served_weights(as_adapter), served_weights(as_merged)

    base, _ = load_policy(tmp_path / "base")
    by_hand = dict(base.named_parameters())  # W + (alpha / r) B A folded by hand from the adapter's file
    weights = load_file(as_adapter / "adapter" / "adapter_model.safetensors")
    cfg = json.loads((as_adapter / "adapter" / "adapter_config.json").read_text())
    for key, a in weights.items():
        if ".lora_A." not in key:
            continue
        layer = key.split("base_model.model.", 1)[1].split(".lora_A.")[0]
        b = weights[key.replace(".lora_A.", ".lora_B.")]
        by_hand[layer + ".weight"] = by_hand[layer + ".weight"].detach() + \
            (cfg["lora_alpha"] / cfg["r"] * (b.double() @ a.double())).float()
    evaluated = dict(load_engine(as_adapter)[0].model.named_parameters())
    for name, p in served.named_parameters():
        torch.testing.assert_close(p, by_hand[name].detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(evaluated[name], p, rtol=0, atol=1e-6)
    moved = max((p - dict(merged.named_parameters())[n]).abs().max().item() for n, p in served.named_parameters())
    assert moved > 1e-4  # the merged export quantized W + s B A: not what the adapter target served
    torch.testing.assert_close(dict(merged.named_parameters()), dict(load_policy(as_merged)[0].named_parameters()),
                               rtol=0, atol=0)
    evaluated = dict(load_engine(as_merged)[0].model.named_parameters())
    torch.testing.assert_close(evaluated, dict(merged.named_parameters()), rtol=0, atol=0)
