"""NVFP4 export: bit-exact against compressed-tensors (quantize, pack, dequantize), error bounds,
the checkpoint vLLM reads, the quantized deployment through LocalEngine, and bad inputs."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.quant import nvfp4
from prodrl_pipelines.quant.export import (
    ExportError, NonFiniteWeightsError, export_nonfinite, export_policy, layer_error_markdown, layer_error_png,
)

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is a test extra (pip install '.[test]')")
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])
HALF_STEP = torch.tensor([0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0, 1.0])  # half the E2M1 step above each |code|


def ct_compress(w, g=None):
    """compressed-tensors' own pipeline: generate_gparam -> calculate_qparams -> NVFP4PackedCompressor."""
    g = generate_gparam(w.amin(), w.amax()) if g is None else g
    groups = w.unflatten(-1, (w.shape[1] // 16, 16))
    s, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights, global_scale=g)
    return NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": s, "weight_global_scale": g, "weight_zero_point": zp}, SCHEME)


def ct_dequantize_fp32(packed, scale, g):
    n, half = packed.shape
    x_q = unpack_fp4_from_uint8(packed, n, half * 2, dtype=torch.float32)
    return dequantize(x_q=x_q, scale=scale.to(torch.float32), args=SCHEME.weights, global_scale=g, dtype=torch.float32)


def hard_tensor(seed, dtype=torch.float32, n=48, k=128):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 10.0 ** float(seed % 7 - 4)
    w[0, :16] = 0.0  # zero block -> scale 0.125
    w[1, 16:32] *= 1e-9  # tiny block -> subnormal / zero FP8 scale
    w[2, 3] = -0.0
    w[3, :16] = -w[3, :16].abs() * 1e-6  # negatives that round to -0 (code 8)
    w[4] *= 1e4  # wide dynamic range inside the tensor
    return w.to(dtype)


def error_bound(w, q):
    """Per element: eff * half the FP4 step at |code| + the FP8 scale rounding (|w| beyond 6 * eff)."""
    n, k = w.shape
    eff = (q.scale.float() / q.global_scale).repeat_interleave(16, dim=1)
    codes = nvfp4.unpack_codes(q.packed).long() & 7
    bamax = w.float().abs().reshape(n, k // 16, 16).amax(-1).repeat_interleave(16, dim=1)
    return eff * HALF_STEP[codes] + (bamax - 6 * eff).clamp(min=0) + 1e-6 * w.float().abs()


# ------------------------------------------------------------------------------ the quantizer

def test_fp4_rounding_ties_to_even_and_signed_zero():
    x = torch.tensor([0.0, 0.25, 0.2500001, 0.75, 0.7499999, 1.25, 1.2500001, 1.75, 2.5, 2.5000002, 3.5, 5.0,
                      5.0000005, 6.0, 7.0, -0.25, -0.0, -1.75])
    want = [0, 0, 1, 2, 1, 2, 3, 4, 4, 5, 6, 6, 7, 7, 7, 8, 0, 8 | 4]
    assert nvfp4.fp4_codes(x).tolist() == want
    # Through the full quantizer: a block whose amax is 6 with g = 1 has block scale exactly 1.
    w = torch.zeros(2, 32)
    w[0, 0] = 2688.0  # tensor amax -> g = 448 * 6 / 2688 = 1
    w[1, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 0.5, 1.5, 3.0, 4.0])
    q = nvfp4.quantize_nvfp4(w)
    assert q.global_scale.item() == 1.0 and q.scale.float()[1, 0].item() == 1.0
    assert q.scale.float()[1, 1].item() == nvfp4.ZERO_SCALE  # an all-zero block
    assert nvfp4.unpack_codes(q.packed)[1, :16].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 12, 14, 1, 3, 5, 6]
    r = ct_compress(w)
    assert torch.equal(r["weight_packed"], q.packed)


def test_packing_puts_the_lower_index_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert nvfp4.pack_codes(codes).tolist() == [[0x21, 0x0F]]
    assert torch.equal(nvfp4.unpack_codes(nvfp4.pack_codes(codes)), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_quantizer_matches_compressed_tensors_bit_for_bit(seed, dtype):
    w = hard_tensor(seed, dtype)
    q = nvfp4.quantize_nvfp4(w)
    r = ct_compress(w)
    assert torch.equal(r["weight_global_scale"], q.global_scale)
    assert torch.equal(r["weight_scale"].view(torch.uint8), q.scale.view(torch.uint8))
    assert torch.equal(r["weight_packed"], q.packed)
    # dequantization: compressed-tensors' unpack + dequantize (fp32) and its decompressor (bf16)
    ours = q.dequantize()
    theirs = ct_dequantize_fp32(q.packed, q.scale, q.global_scale)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # bitwise, signed zeros included
    dec = NVFP4PackedCompressor.decompress(
        {"weight_packed": q.packed, "weight_scale": q.scale, "weight_global_scale": q.global_scale}, SCHEME)
    assert torch.equal(dec["weight"].view(torch.int16), ours.to(torch.bfloat16).view(torch.int16))


def test_shared_global_scale_matches_compressed_tensors():
    a, b = hard_tensor(1), hard_tensor(2) * 3
    g = torch.minimum(nvfp4.global_scale(a), nvfp4.global_scale(b))
    for w in (a, b):
        q = nvfp4.quantize_nvfp4(w, g)
        r = ct_compress(w, g)
        assert torch.equal(r["weight_packed"], q.packed)
        assert torch.equal(r["weight_scale"].view(torch.uint8), q.scale.view(torch.uint8))


def test_all_zero_tensor_gets_global_scale_one():
    q = nvfp4.quantize_nvfp4(torch.zeros(4, 32))
    assert q.global_scale.item() == 1.0 and torch.equal(ct_compress(torch.zeros(4, 32))["weight_packed"], q.packed)
    assert torch.equal(q.dequantize(), torch.zeros(4, 32))


@pytest.mark.parametrize("seed", range(4))
def test_random_weights_error_within_bound(seed):
    w = hard_tensor(seed)
    q = nvfp4.quantize_nvfp4(w)
    err = (q.dequantize() - w).abs()
    assert bool((err <= error_bound(w, q)).all())
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(256, 512, generator=g) * 0.02
    qg = nvfp4.quantize_nvfp4(gauss)
    rel = float((qg.dequantize() - gauss).norm() / gauss.norm())
    assert 0.05 < rel < 0.13  # NVFP4 on Gaussian weights: ~9-10% relative Frobenius error


def test_bad_tensors_are_refused_by_name():
    with pytest.raises(nvfp4.NVFP4Error, match=r"layers\.0\.q_proj\.weight.*not divisible by the NVFP4 block size 16"):
        nvfp4.quantize_nvfp4(torch.randn(8, 40), name="layers.0.q_proj.weight")
    w = torch.randn(8, 32)
    w[2, 5] = float("inf")
    with pytest.raises(nvfp4.NVFP4Error, match=r"up_proj\.weight: 1 non-finite"):
        nvfp4.quantize_nvfp4(w, name="mlp.up_proj.weight")
    with pytest.raises(nvfp4.NVFP4Error, match="2-D"):
        nvfp4.quantize_nvfp4(torch.randn(2, 8, 32))


def test_which_tensors_are_quantized_and_fused():
    q = lambda n, shape=(32, 32): nvfp4.quantizable(n, torch.zeros(shape))  # noqa: E731
    assert q("model.layers.0.self_attn.q_proj.weight") and q("model.layers.3.mlp.experts.7.down_proj.weight")
    for skip in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.shared_expert_gate.weight"):
        assert not q(skip), skip
    assert not q("model.norm.weight", (32,))
    assert nvfp4.fused_group("model.layers.1.self_attn.k_proj.weight") == "model.layers.1.self_attn.qkv_proj"
    assert nvfp4.fused_group("model.layers.1.mlp.experts.3.up_proj.weight") == "model.layers.1.mlp.experts.3.gate_up_proj"
    assert nvfp4.fused_group("model.layers.1.mlp.experts.3.gate_proj.weight") == "model.layers.1.mlp.experts.3.gate_up_proj"
    assert nvfp4.fused_group("model.layers.1.mlp.experts.3.down_proj.weight").endswith("down_proj.weight")


# ------------------------------------------------------------------------------ the export

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny lab base policy (Qwen3-MoE, SFT-warm-started: real, trained weights)."""
    from prodrl_pipelines.lab.warmstart import build_base_policy

    return build_base_policy(tmp_path_factory.mktemp("base") / "ckpt", size="tiny", progress=False)


@pytest.fixture(scope="module")
def w4a16(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "w4a16"
    return out, export_policy(base, out)


def test_export_is_the_checkpoint_vllm_reads(base, w4a16):
    out, rep = w4a16
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # the library vLLM uses parses it
    assert parsed.format == "nvfp4-pack-quantized" and parsed.quant_method == "compressed-tensors"
    ref = preset_name_to_scheme("NVFP4A16", ["Linear"])
    ref.format = "nvfp4-pack-quantized"
    assert parsed.config_groups["group_0"] == ref
    assert qc == QuantizationConfig(config_groups={"group_0": ref}, format="nvfp4-pack-quantized", ignore=qc["ignore"],
                                    quantization_status="compressed").model_dump(mode="json")
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.gate"]
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (base / f).read_bytes(), f
    sd = load_file(out / "model.safetensors")
    src = load_file(base / "model.safetensors")
    linear = [k for k in src if k.endswith("proj.weight")]
    assert len(linear) == rep["quantized_tensors"] == 4 + 3 * 4
    for k in linear:
        p = k[: -len(".weight")]
        n, kk = src[k].shape
        assert sd[f"{p}.weight_packed"].dtype == torch.uint8 and sd[f"{p}.weight_packed"].shape == (n, kk // 2)
        assert sd[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn and sd[f"{p}.weight_scale"].shape == (n, kk // 16)
        assert sd[f"{p}.weight_global_scale"].dtype == torch.float32 and sd[f"{p}.weight_global_scale"].shape == (1,)
        assert k not in sd and f"{p}.input_global_scale" not in sd
        # and the bytes are compressed-tensors' own, under the fused global scale
        r = ct_compress(src[k], sd[f"{p}.weight_global_scale"])
        assert torch.equal(r["weight_packed"], sd[f"{p}.weight_packed"])
    for k in ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight"):
        assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], src[k].to(torch.bfloat16))
    att = "model.layers.0.self_attn"
    gs = {p: sd[f"{att}.{p}.weight_global_scale"] for p in ("q_proj", "k_proj", "v_proj")}
    assert gs["q_proj"] == gs["k_proj"] == gs["v_proj"]
    assert gs["q_proj"] == min(nvfp4.global_scale(src[f"{att}.{p}.weight"]) for p in gs)
    for e in range(4):
        ex = f"model.layers.0.mlp.experts.{e}"
        assert sd[f"{ex}.gate_proj.weight_global_scale"] == sd[f"{ex}.up_proj.weight_global_scale"]
    assert rep["compression_ratio"] > 1.5 and rep["export_bytes"] == (out / "model.safetensors").stat().st_size
    assert json.loads((out / "prodrl_export.json").read_text())["scheme"] == "nvfp4-w4a16"


def test_real_weights_error_within_bound_and_reported(base, w4a16):
    out, rep = w4a16
    src = load_file(base / "model.safetensors")
    sd = load_file(out / "model.safetensors")
    rows = {r["name"]: r for r in rep["layers"]}
    for k, w in src.items():
        p = k[: -len(".weight")]
        if f"{p}.weight_packed" not in sd:
            continue
        q = nvfp4.NVFP4Tensor(sd[f"{p}.weight_packed"], sd[f"{p}.weight_scale"], sd[f"{p}.weight_global_scale"])
        deq = q.dequantize()
        assert bool(((deq - w).abs() <= error_bound(w, q)).all()), k
        rel = float((deq - w).norm() / w.norm())
        assert rows[k]["format"] == "nvfp4" and rows[k]["rel_fro_error"] == pytest.approx(rel, rel=1e-6)
        assert rel < 0.15
    assert rows["model.norm.weight"]["format"] == "bf16" and rows["model.norm.weight"]["rel_fro_error"] < 4e-3
    assert "| tensor |" in layer_error_markdown(rep["layers"]) and layer_error_png(rep["layers"])[:4] == b"\x89PNG"


def test_local_engine_serves_the_dequantized_export(base, w4a16):
    from prodrl_pipelines.rl.checkpoint import load_policy

    out, _ = w4a16
    engine = LocalEngine.from_pretrained(out)
    sd = load_file(out / "model.safetensors")
    msd = engine.model.state_dict()
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    p = "model.layers.0.self_attn.o_proj"
    want = nvfp4.dequantize_nvfp4(sd[f"{p}.weight_packed"], sd[f"{p}.weight_scale"], sd[f"{p}.weight_global_scale"])
    assert torch.equal(msd[f"{p}.weight"], want)
    ex = "model.layers.0.mlp.experts"
    gate = nvfp4.dequantize_nvfp4(sd[f"{ex}.2.gate_proj.weight_packed"], sd[f"{ex}.2.gate_proj.weight_scale"],
                                  sd[f"{ex}.2.gate_proj.weight_global_scale"])
    assert torch.equal(msd[f"{ex}.gate_up_proj"][2, : gate.shape[0]], gate)  # per-expert tensors fused on load
    assert torch.equal(msd["model.norm.weight"], sd["model.norm.weight"].float())
    ref = LocalEngine.from_pretrained(base)
    assert not torch.equal(msd[f"{p}.weight"], ref.model.state_dict()[f"{p}.weight"])  # really quantized
    tok = engine.tokenizer
    prompts = [tok.encode("<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)] * 3
    params = SamplingParams(temperature=1.0, max_tokens=5, num_top_logprobs=4)
    recs = engine.generate(prompts, params, seed=0)
    scored = engine.score([r.prompt_token_ids for r in recs], [r.output_token_ids for r in recs], params)
    for r, s in zip(recs, scored):
        assert len(r.output_token_ids) >= 1 and s == pytest.approx(r.output_logprobs, abs=1e-4)
    model, _ = load_policy(out)  # the trainer-side loader dispatches too (ref_is reference model)
    assert torch.equal(model.state_dict()[f"{p}.weight"], want)
    assert export_nonfinite(out) == {}


def test_w4a4_calibrates_input_global_scales(base, tmp_path):
    from transformers import AutoTokenizer

    from prodrl_pipelines.lab.arithmetic import generate_tasks, initial_messages
    from prodrl_pipelines.lab.episodes import render_prompt
    from prodrl_pipelines.quant.nvfp4 import build_model, dequantize_state_dict

    with pytest.raises(ExportError, match="calibration prompts"):
        export_policy(base, tmp_path / "x", "nvfp4-w4a4")
    tok = AutoTokenizer.from_pretrained(base)
    prompts = [render_prompt(tok, initial_messages(t))[1] for t in generate_tasks(6, seed=1)]
    rep = export_policy(base, tmp_path / "w4a4", "nvfp4-w4a4", calibration_prompts=prompts)
    cfg = json.loads((tmp_path / "w4a4" / "config.json").read_text())["quantization_config"]
    ref = preset_name_to_scheme("NVFP4", ["Linear"])
    ref.format = "nvfp4-pack-quantized"
    assert QuantizationConfig.model_validate(cfg).config_groups["group_0"] == ref
    sd = load_file(tmp_path / "w4a4" / "model.safetensors")
    igs = {k: v for k, v in sd.items() if k.endswith("input_global_scale")}
    assert len(igs) == rep["quantized_tensors"] and all(v.dtype == torch.float32 and v.shape == (1,) for v in igs.values())
    # Independently: amax of the o_proj input and of expert 1's down_proj input on the served (W4) model.
    model = build_model(json.loads((base / "config.json").read_text()), dequantize_state_dict(sd), torch.float32)
    seen = {}
    attn = model.model.layers[0].self_attn
    h = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("o", []).append(a[0].abs().amax()))
    experts = model.model.layers[0].mlp.experts

    def down_in(m, a):
        x = a[0]
        gate, up = torch.nn.functional.linear(x, m.gate_up_proj[1]).chunk(2, dim=-1)
        seen.setdefault("d1", []).append((m.act_fn(gate) * up).abs().amax())
    h2 = experts.register_forward_pre_hook(down_in)
    with torch.inference_mode():
        for p in prompts:
            model(input_ids=torch.tensor([p]))
    h.remove(), h2.remove()
    o = torch.stack(seen["o"]).amax()
    d1 = torch.stack(seen["d1"]).amax()
    assert torch.equal(igs["model.layers.0.self_attn.o_proj.input_global_scale"], generate_gparam(-o, o))
    assert torch.equal(igs["model.layers.0.mlp.experts.1.down_proj.input_global_scale"], generate_gparam(-d1, d1))
    assert LocalEngine.from_pretrained(tmp_path / "w4a4").generate(prompts[:2], SamplingParams(max_tokens=3), seed=0)


def test_bf16_scheme(base, tmp_path):
    rep = export_policy(base, tmp_path / "bf16", "bf16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    assert rep["compression_ratio"] == pytest.approx(1.0, rel=0.1)  # safetensors header overhead on a tiny model
    engine = LocalEngine.from_pretrained(tmp_path / "bf16")
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


# ------------------------------------------------------------------------------ bad input

def _copy(base, dst):
    shutil.copytree(base, dst)
    return dst


def test_non_finite_weights_refused_nothing_half_written(base, tmp_path):
    out = tmp_path / "exp"
    export_policy(base, out)  # a previous good export at the destination
    before = (out / "model.safetensors").read_bytes()
    bad = _copy(base, tmp_path / "bad")
    sd = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    sd[name][1, 1] = float("nan")
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightsError, match=name.replace(".", r"\.")) as ei:
        export_policy(bad, out)
    assert ei.value.tensors == {name: 1}
    assert (out / "model.safetensors").read_bytes() == before  # the previous export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "exp"]  # no temp dirs left behind
    with pytest.raises(NonFiniteWeightsError):
        export_policy(bad, tmp_path / "bf16", "bf16")
    assert not (tmp_path / "bf16").exists()


def test_missing_tensors_unknown_scheme_and_bad_shapes(base, tmp_path):
    with pytest.raises(ExportError, match="unknown export scheme 'nvfp8'"):
        export_policy(base, tmp_path / "x", "nvfp8")
    for i, name in enumerate(["model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"]):
        ck = _copy(base, tmp_path / f"missing{i}")
        sd = load_file(ck / "model.safetensors")
        del sd[name]
        save_file(sd, ck / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ExportError, match=name.replace(".", r"\.")):
            export_policy(ck, tmp_path / f"out{i}")
        assert not (tmp_path / f"out{i}").exists()
    with pytest.raises(ExportError, match="config.json missing"):
        export_policy(tmp_path / "nowhere", tmp_path / "out")
    # a dense model whose hidden size (40) is not a multiple of 16
    from prodrl_pipelines.lab.model import build_model, lab_model_config
    from prodrl_pipelines.lab.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = build_model(lab_model_config("tiny", vocab_size=len(tok), arch="dense", hidden_size=40))
    model.save_pretrained(tmp_path / "dense40")
    tok.save_pretrained(tmp_path / "dense40")
    with pytest.raises(ExportError, match=r"divisible by 16.*q_proj\.weight \(32, 40\)"):
        export_policy(tmp_path / "dense40", tmp_path / "out40")
    assert not (tmp_path / "out40").exists()
    export_policy(tmp_path / "dense40", tmp_path / "out40", "bf16")  # bf16 has no block constraint


def test_incomplete_export_and_nonfinite_scales_are_caught(w4a16, tmp_path):
    out = _copy(w4a16[0], tmp_path / "exp")
    sd = load_file(out / "model.safetensors")
    p = "model.layers.0.self_attn.v_proj"
    sd[f"{p}.weight_scale"] = sd[f"{p}.weight_scale"].float().index_put_((torch.tensor([0]), torch.tensor([0])),
                                                                        torch.tensor(float("nan"))).to(torch.float8_e4m3fn)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    bad = export_nonfinite(out)
    assert set(bad) == {f"{p}.weight", f"{p}.weight_scale"} and bad[f"{p}.weight"] == 16
    del sd[f"{p}.weight_global_scale"]
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(nvfp4.NVFP4Error, match=f"{p}.weight_global_scale is missing"):
        LocalEngine.from_pretrained(out)
    for k in [k for k in sd if k.startswith(p)]:
        del sd[k]
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(nvfp4.NVFP4Error, match=r"tensors missing.*v_proj"):
        LocalEngine.from_pretrained(out)


def test_export_scheme_setting_is_validated():
    from pydantic import ValidationError

    from prodrl_pipelines.config.settings import DeploySettings

    assert DeploySettings().export_scheme == "nvfp4-w4a16"
    with pytest.raises(ValidationError, match="export_scheme"):
        DeploySettings(export_scheme="int4")


# ------------------------------------------------------------------------------ streaming

def test_a_chunked_sharded_export_is_the_whole_tensor_export(base, w4a16, tmp_path, monkeypatch):
    """Every tensor quantized, cast and measured in row chunks of a few rows, written into many
    shards: the same tensors, bytes and errors as the one-file export, readable by safetensors."""
    from prodrl_pipelines.quant import export as export_mod

    monkeypatch.setattr(export_mod, "CHUNK_BYTES", 512)  # a handful of rows per chunk
    out = tmp_path / "sharded"
    rep = export_policy(base, out, max_shard_bytes=4_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists() and not list(out.glob(".shard-*"))
    sharded = {}
    for f in files:
        sharded.update(load_file(out / f))
    whole = load_file(w4a16[0] / "model.safetensors")
    assert sharded.keys() == whole.keys()
    for k in whole:
        assert sharded[k].dtype == whole[k].dtype and torch.equal(sharded[k].view(torch.uint8), whole[k].view(torch.uint8)), k
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sharded.values())
    rows = {r["name"]: r["rel_fro_error"] for r in w4a16[1]["layers"]}
    for r in rep["layers"]:
        assert r["rel_fro_error"] == pytest.approx(rows[r["name"]], rel=1e-9, abs=1e-12), r["name"]


def test_the_chunk_reader_reads_what_safetensors_wrote(tmp_path):
    from prodrl_pipelines.quant.safetensors_stream import CheckpointReader, SafetensorsError

    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(37, 5, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
          "c": torch.arange(12, dtype=torch.int64).reshape(3, 4), "s": torch.tensor(2.5),
          "f8": torch.randn(9, 16, generator=g).to(torch.float8_e4m3fn)}
    save_file(sd, tmp_path / "model.safetensors")
    r = CheckpointReader(tmp_path)
    for k, t in sd.items():
        assert torch.equal(r.get(k).view(torch.uint8), t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn \
            else torch.equal(r.get(k), t), k
        assert torch.equal(torch.cat(list(r.chunks(k, 24))) if t.dim() >= 2 else r.get(k), r.get(k)), k
    assert torch.equal(r.rows("a", 10, 13), sd["a"][10:13])
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:200])
    with pytest.raises(SafetensorsError, match="truncated|header"):
        CheckpointReader(tmp_path).get("a")


def test_a_tensor_of_the_wrong_shape_is_refused_by_name(base, tmp_path):
    ck = _copy(base, tmp_path / "ck")
    sd = load_file(ck / "model.safetensors")
    sd["model.norm.weight"] = torch.ones(sd["model.norm.weight"].shape[0] + 1)
    save_file(sd, ck / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"wrong shape.*model\.norm\.weight"):
        export_policy(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()
