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
    with pytest.raises(ValueError, match="ref_is.*lora"):
        settings_from_flat({"training": "lora", "correction": "ref_is"})
    with pytest.raises(ValueError, match="lora_rank"):
        settings_from_flat({"training": "lora", "lora_rank": 0})
