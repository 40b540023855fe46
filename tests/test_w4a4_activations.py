"""W4A4 activation quantization simulated at serving: the fake-quant recipe (bit-consistent with the
weight recipe), the hooks a W4A4 export gets in the deployment (LocalEngine) and not in the trainer's
weights-only view (load_policy)."""

import math

import pytest
import torch
from safetensors.torch import load_file

from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.quant import nvfp4
from prodrl_pipelines.quant.export import export_policy
from prodrl_pipelines.rl.checkpoint import load_policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _x(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen).mul(4).exp()  # per-channel spread
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gmul", [1.0, 0.05])  # 0.05: a calibration amax below the tensor's (scales clamp at 448)
def test_fake_quant_equals_quantize_dequantize(dtype, gmul):
    x = _x((3, 5, 64), dtype)
    g = nvfp4.global_scale(x) * gmul
    got = nvfp4.fake_quantize_activations(x, g)
    q = nvfp4.quantize_nvfp4(x.reshape(-1, 64), g)
    want = nvfp4.dequantize_nvfp4(q.packed, q.scale, q.global_scale, dtype).reshape(x.shape)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    assert not torch.equal(got, x)


def test_fake_quant_idempotent():
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    g = nvfp4.global_scale(x)
    once = nvfp4.fake_quantize_activations(x, g)
    assert torch.equal(nvfp4.fake_quantize_activations(once, g), once)


def test_fake_quant_zeros_stay_zero():
    x = _x((4, 48))
    x[1] = 0  # a zero row (token)
    x[2, 16:32] = 0  # a zero block
    g = nvfp4.global_scale(x)
    y = nvfp4.fake_quantize_activations(x, g)
    assert torch.equal(y[1], torch.zeros(48)) and torch.equal(y[2, 16:32], torch.zeros(16))
    z = torch.zeros(2, 32)
    assert torch.equal(nvfp4.fake_quantize_activations(z, nvfp4.global_scale(z)), z)
    with pytest.raises(nvfp4.NVFP4Error, match="divisible"):
        nvfp4.fake_quantize_activations(torch.ones(2, 20), torch.ones(1))


# --------------------------------------------------------------------------------- exports

@pytest.fixture(scope="module")
def prompts(tiny_policy_dir):
    from transformers import AutoTokenizer

    from prodrl_pipelines.lab.arithmetic import generate_tasks, initial_messages
    from prodrl_pipelines.lab.episodes import render_prompt

    tok = AutoTokenizer.from_pretrained(tiny_policy_dir)
    return [render_prompt(tok, initial_messages(t))[1] for t in generate_tasks(6, seed=3)]


@pytest.fixture(scope="module")
def exports(tiny_policy_dir, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("w4a4")
    export_policy(tiny_policy_dir, out / "w4a4", "nvfp4-w4a4", calibration_prompts=prompts)
    export_policy(tiny_policy_dir, out / "w4a16", "nvfp4-w4a16")
    return out / "w4a4", out / "w4a16"


def _logprobs(model, prompts):
    with torch.inference_mode():
        return [torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0].float(), -1) for p in prompts]


def test_hooks_change_w4a4_logits_and_leave_w4a16_alone(exports, prompts):
    w4a4, w4a16 = exports
    sim, _ = nvfp4.load_nvfp4_model(w4a4, simulate_activations=True)
    plain, _ = nvfp4.load_nvfp4_model(w4a4)
    n_scales = sum(k.endswith(".input_global_scale") for k in load_file(w4a4 / "model.safetensors"))
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in sim.modules()) - 1  # all but lm_head
    assert len(sim._w4a4_hooks) == n_linear and sim._w4a4_experts and plain._w4a4_hooks == []
    n_experts = sum(m.gate_up_proj.shape[0] for n, m in sim.named_modules() if n in sim._w4a4_experts)
    assert n_scales == n_linear + 3 * n_experts  # every scale was installed
    a, b = _logprobs(sim, prompts), _logprobs(plain, prompts)
    diff = torch.cat([(x - y).abs().flatten() for x, y in zip(a, b)])
    top = torch.cat([(x.argmax(-1) == y.argmax(-1)).float() for x, y in zip(a, b)])
    print(f"\nW4A4 activations vs weights-only: mean |d logprob| {diff.mean():.4g}, max {diff.max():.4g}, "
          f"argmax agreement {top.mean():.3f}")
    assert diff.mean() > 1e-3 and all(torch.isfinite(x).all() for x in a)
    assert top.mean() > 0.5  # a perturbation, not a broken model
    # W4A16: no input scales, so the flag changes nothing (identical logits)
    s16, _ = nvfp4.load_nvfp4_model(w4a16, simulate_activations=True)
    p16, _ = nvfp4.load_nvfp4_model(w4a16)
    assert s16._w4a4_hooks == [] and not getattr(s16, "_w4a4_experts", [])
    assert all(torch.equal(x, y) for x, y in zip(_logprobs(s16, prompts), _logprobs(p16, prompts)))
    # the W4A16 export is the W4A4 export's weights: weights-only logits are the same
    assert all(torch.equal(x, y) for x, y in zip(b, _logprobs(p16, prompts)))


def test_experts_wrapper_matches_per_token_reference(exports):
    sim, _ = nvfp4.load_nvfp4_model(exports[0], simulate_activations=True)
    experts = sim.get_submodule(sim._w4a4_experts[0])
    E, _, H = experts.gate_up_proj.shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=gen)
    with torch.no_grad():
        got = experts(x, idx, w)
        want = torch.zeros_like(x)
        for t in range(7):
            for k in range(2):
                e = int(idx[t, k])
                q = nvfp4.quantize_nvfp4(x[t:t + 1], experts._w4a4_gate_up[e])
                gate, up = torch.nn.functional.linear(q.dequantize(), experts.gate_up_proj[e]).chunk(2, dim=-1)
                q = nvfp4.quantize_nvfp4(experts.act_fn(gate) * up, experts._w4a4_down[e])
                want[t] += w[t, k] * torch.nn.functional.linear(q.dequantize(), experts.down_proj[e])[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_engine_serves_w4a4_with_activations_and_rescores_consistently(exports, prompts):
    engine = LocalEngine.from_pretrained(exports[0])
    assert engine.model._w4a4_hooks
    params = SamplingParams(temperature=1.0, max_tokens=8, num_top_logprobs=4)
    recs = engine.generate(prompts, params, seed=5)
    scored = engine.score(prompts, [r.output_token_ids for r in recs], params)
    for r, s in zip(recs, scored):
        assert len(r.output_token_ids) >= 1 and all(math.isfinite(v) for v in r.output_logprobs)
        assert s == pytest.approx(r.output_logprobs, abs=1e-4)
    weights_only = LocalEngine.from_pretrained(exports[0], simulate_activations=False)
    assert weights_only.model._w4a4_hooks == []
    other = weights_only.score(prompts, [r.output_token_ids for r in recs], params)
    d = [abs(a - b) for r, o in zip(recs, other) for a, b in zip(r.output_logprobs, o)]
    assert sum(d) / len(d) > 1e-4  # the deployment differs from the upcast weights


def test_load_policy_of_w4a4_is_weights_only(exports, prompts):
    model, _ = load_policy(exports[0])
    assert model._w4a4_hooks == []
    plain, _ = nvfp4.load_nvfp4_model(exports[0])
    assert all(torch.equal(x, y) for x, y in zip(_logprobs(model, prompts[:2]), _logprobs(plain, prompts[:2])))
