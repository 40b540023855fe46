"""NVFP4 weights in the compressed-tensors convention (the ``nvfp4-pack-quantized`` format vLLM loads).

A weight ``W`` [N, K] (``nn.Linear`` layout, K = input dimension) becomes

- ``weight_global_scale`` float32 [1]: ``g = 448 * 6 / amax(|W|)`` (FP8 max times FP4 max over the
  tensor's absolute maximum; an all-zero tensor gets ``g = 1``). Layers that are fused at serving
  time (q/k/v, gate/up, per-expert gate/up in MoE) share one ``g``: the minimum of theirs.
- ``weight_scale`` float8_e4m3fn [N, K/16]: per block of 16 inputs ``s = fp8(g * (block_amax / 6))``,
  clamped to 448; a scale that rounds to 0 is stored as 0.125 (FP8's eps in compressed-tensors).
- ``weight_packed`` uint8 [N, K/2]: E2M1 codes of ``W / (s / g)`` (clamped to +-6, magnitudes
  0, .5, 1, 1.5, 2, 3, 4, 6, round to nearest with ties to the even code; bit 3 is the sign, set for
  negative inputs even when they round to 0), two per byte, the lower-index element in the low nibble.

Dequantisation is ``code * (s / g)`` (``s / g`` first, in float32), exactly what compressed-tensors'
``NVFP4PackedCompressor.decompress`` computes before its final cast, so the two match bit for bit.
Every formula above mirrors compressed-tensors 0.20 (``generate_gparam``, ``calculate_qparams``,
``cast_to_fp4``, ``pack_fp4_to_uint8``) including the arithmetic dtype: statistics are taken in the
weight's own dtype (bf16 weights: bf16 ``amax / 6`` and ``2688 / amax``), the rest in float32. The
library itself is only needed by the tests and benchmarks, never here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "FORMAT", "GROUP_SIZE", "FP4_MAX", "FP8_MAX", "ZERO_SCALE", "NVFP4Error", "NVFP4Tensor",
    "global_scale", "block_scales", "fp4_codes", "pack_codes", "unpack_codes", "quantize_nvfp4",
    "dequantize_nvfp4", "fused_group", "quantizable", "quantization_config", "is_compressed_tensors_dir",
    "dequantize_state_dict", "build_model", "load_nvfp4_model", "read_safetensors_dir", "open_safetensors_dir",
    "fake_quantize_activations", "install_activation_quantization",
]

FORMAT = "nvfp4-pack-quantized"
GROUP_SIZE = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
ZERO_SCALE = 0.125  # compressed-tensors `_get_dtype_eps(float8_e4m3fn)`: a zero block scale becomes this

# |code| of |x| = how many of these thresholds |x| passes. Ties go to the even code (0.25->0, 0.75->1,
# 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), as in compressed-tensors' `cast_to_fp4`: strict ">" where the
# lower neighbour is even, ">=" where the upper one is.
_THRESHOLDS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))
_F32 = torch.float32
# code -> value; code 8 is -0.0 (a negative input that rounded to zero)
_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=_F32)
_LUT = torch.cat([_VALUES, -_VALUES])


class NVFP4Error(ValueError):
    """A tensor or checkpoint that cannot be quantized/loaded; the message names the tensor."""


@dataclass
class NVFP4Tensor:
    packed: Tensor  # uint8 [N, K/2]
    scale: Tensor  # float8_e4m3fn [N, K/16]
    global_scale: Tensor  # float32 [1]

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.packed.shape[0]), int(self.packed.shape[1]) * 2

    def dequantize(self, dtype: torch.dtype = _F32) -> Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.global_scale, dtype)


def _stat_dtype(w: Tensor) -> torch.dtype:
    return w.dtype if w.dtype in (torch.bfloat16, torch.float16, torch.float32) else _F32


def _check(w: Tensor, name: str) -> None:
    if w.ndim != 2:
        raise NVFP4Error(f"{name}: NVFP4 quantizes 2-D [out, in] weights, got shape {tuple(w.shape)}")
    if w.shape[1] % GROUP_SIZE:
        raise NVFP4Error(f"{name}: input dimension {w.shape[1]} (shape {tuple(w.shape)}) is not divisible by "
                         f"the NVFP4 block size {GROUP_SIZE}; add the layer to the ignore list")
    if not w.is_floating_point():
        raise NVFP4Error(f"{name}: expected a floating-point weight, got {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        n = int((~torch.isfinite(w)).sum())
        raise NVFP4Error(f"{name}: {n} non-finite (NaN/Inf) weights; refusing to export them")


def global_scale(w: Tensor) -> Tensor:
    """``448 * 6 / amax(|w|)`` as float32 [1] (``generate_gparam``); 1.0 where that is not finite."""
    amax = w.abs().amax().to(_stat_dtype(w)).reshape(1)
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    g = (FP8_MAX * FP4_MAX) / amax
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(_F32)


def block_scales(w: Tensor, gscale: Tensor) -> Tensor:
    """FP8 block scales [N, K/16] of ``w`` under global scale ``gscale`` (``calculate_qparams``)."""
    n, k = w.shape
    bamax = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE).abs().amax(-1)
    s = gscale.to(_F32) * (bamax / torch.tensor(FP4_MAX, dtype=bamax.dtype))
    s = s.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.where(s.to(_F32) == 0, torch.tensor(ZERO_SCALE, dtype=_F32), s.to(_F32)).to(torch.float8_e4m3fn)


def fp4_codes(y: Tensor) -> Tensor:
    """E2M1 codes (uint8, sign in bit 3) of float32 values ``y`` already divided by their scale.

    Seven threshold comparisons accumulated in uint8 (~4x faster on CPU than ``torch.bucketize``)."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t, strict in _THRESHOLDS:
        code += (a > t) if strict else (a >= t)
    code |= (y < 0).to(torch.uint8) << 3
    return code


def pack_codes(codes: Tensor) -> Tensor:
    """Two codes per byte along the last dimension, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: Tensor) -> Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def quantize_nvfp4(w: Tensor, gscale: Tensor | None = None, name: str = "weight") -> NVFP4Tensor:
    """Quantize one [N, K] weight (K divisible by 16, finite); ``gscale`` overrides the tensor's own
    global scale (layers fused at serving time share one)."""
    _check(w, name)
    g = global_scale(w) if gscale is None else gscale.to(_F32).reshape(1)
    s8 = block_scales(w, g)
    n, k = w.shape
    eff = s8.to(_F32) / g  # [N, K/16]
    y = w.to(_F32).reshape(n, k // GROUP_SIZE, GROUP_SIZE) / eff.unsqueeze(-1)
    packed = pack_codes(fp4_codes(y).reshape(n, k))
    return NVFP4Tensor(packed=packed, scale=s8, global_scale=g.clone())


def dequantize_nvfp4(packed: Tensor, scale: Tensor, gscale: Tensor, dtype: torch.dtype = _F32) -> Tensor:
    """``code * (scale / global_scale)`` in float32, cast to ``dtype``."""
    n, half = packed.shape
    k = half * 2
    if scale.shape != (n, k // GROUP_SIZE):
        raise NVFP4Error(f"weight_scale shape {tuple(scale.shape)} does not match weight_packed {tuple(packed.shape)} "
                         f"(expected {(n, k // GROUP_SIZE)})")
    vals = _LUT.to(packed.device)[unpack_codes(packed).long()]
    eff = scale.to(_F32) / gscale.to(_F32).reshape(1)
    return (vals.reshape(n, k // GROUP_SIZE, GROUP_SIZE) * eff.unsqueeze(-1)).reshape(n, k).to(dtype)


def fake_quantize_activations(x: Tensor, input_global_scale: Tensor) -> Tensor:
    """W4A4 activation quantize-dequantize of ``x`` along its last dimension (what the deployment's
    NVFP4 W4A4 kernels feed their GEMM): blocks of 16 inputs, FP8 E4M3 block scales computed dynamically
    per token-block from the block amax under the static ``input_global_scale``, E2M1 codes; the weight
    recipe (``block_scales``, ``fp4_codes``, ``code * (s / g)``) applied to activations, in float32.

    Bit for bit ``dequantize_nvfp4(quantize_nvfp4(x.reshape(-1, K), g))`` reshaped back, cast to
    ``x.dtype``; rows (tokens) are independent, so batching and KV caching do not change the result.
    Unlike ``quantize_nvfp4`` it does not validate: non-finite inputs give non-finite outputs.
    """
    k = x.shape[-1]
    if k % GROUP_SIZE:
        raise NVFP4Error(f"activation dimension {k} is not divisible by the NVFP4 block size {GROUP_SIZE}")
    g = input_global_scale.to(device=x.device, dtype=_F32).reshape(1)
    rows = x.reshape(-1, k)
    eff = block_scales(rows, g).to(_F32) / g  # [rows, K/16]; block amax taken in x's dtype, as for weights
    y = rows.to(_F32).reshape(-1, k // GROUP_SIZE, GROUP_SIZE) / eff.unsqueeze(-1)
    vals = _LUT.to(x.device)[fp4_codes(y).long()]
    return (vals * eff.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


# --------------------------------------------------------------------------------- which tensors

_FUSED = [
    (re.compile(r"^(.*)\.(q_proj|k_proj|v_proj)\.weight$"), "qkv_proj"),
    (re.compile(r"^(.*)\.(gate_proj|up_proj)\.weight$"), "gate_up_proj"),  # also experts.<e>.gate/up_proj
]
_SKIP = re.compile(
    r"(^|\.)(lm_head|embed_tokens|embeddings?|wte|wpe|shared_expert_gate|router)$"  # heads, embeddings, routers
    r"|(^|\.)mlp\.gate$"  # MoE router gate (Qwen*-MoE, Mixtral-style `.mlp.gate`)
    r"|norm[^.]*$"  # every *norm module
)


def fused_group(name: str) -> str:
    """The group of weights sharing one global scale (fused at serving time): ``name`` itself if none."""
    for pat, fused in _FUSED:
        m = pat.match(name)
        if m:
            return f"{m.group(1)}.{fused}"
    return name


def quantizable(name: str, t: Tensor) -> bool:
    """Linear weights: 2-D ``*.weight`` floats, not lm_head, embeddings, norms or MoE router gates."""
    if not name.endswith(".weight") or t.ndim != 2 or not t.is_floating_point():
        return False
    return _SKIP.search(name[: -len(".weight")]) is None


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    """The ``quantization_config`` block of config.json vLLM reads (as compressed-tensors 0.20 writes it
    for its presets NVFP4A16 = ``w4a16`` and NVFP4 = ``w4a4``)."""
    if scheme not in ("w4a16", "w4a4"):
        raise NVFP4Error(f"unknown NVFP4 scheme {scheme!r}; choose 'w4a16' or 'w4a4'")
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP_SIZE,
               "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    acts = None
    if scheme == "w4a4":
        acts = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP_SIZE,
                "strategy": "tensor_group", "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn",
                "observer": "static_minmax"}
    return {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": FORMAT}},
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": FORMAT,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "moe_sparsity_config": None,
    }


# --------------------------------------------------------------------------------- loading

def read_safetensors_dir(path: str | PathLike) -> dict[str, Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint directory, in memory."""
    return dict(open_safetensors_dir(path))


def open_safetensors_dir(path: str | PathLike):
    """The directory's tensors, each read when asked for (``quant.safetensors_stream``)."""
    from prodrl_pipelines.quant.safetensors_stream import CheckpointReader, SafetensorsError

    try:
        return CheckpointReader(path)
    except SafetensorsError as e:
        raise NVFP4Error(str(e)) from e


def is_compressed_tensors_dir(path: str | PathLike) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return False
    qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors"


def dequantize_state_dict(sd: Mapping[str, Tensor], dtype: torch.dtype = _F32) -> dict[str, Tensor]:
    """Packed NVFP4 triplets -> dense ``<prefix>.weight``; activation scales dropped; the rest cast.
    ``sd`` may read each tensor when asked for (a ``CheckpointReader``): one packed tensor at a time."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        if key.endswith(".weight_packed"):
            prefix = key[: -len(".weight_packed")]
            for part in ("weight_scale", "weight_global_scale"):
                if f"{prefix}.{part}" not in sd:
                    raise NVFP4Error(f"{prefix}: {prefix}.{part} is missing next to {key}")
            out[f"{prefix}.weight"] = dequantize_nvfp4(t, sd[f"{prefix}.weight_scale"],
                                                       sd[f"{prefix}.weight_global_scale"], dtype)
        elif key.endswith((".weight_scale", ".weight_global_scale", ".input_global_scale")):
            prefix = key.rsplit(".", 1)[0]
            if f"{prefix}.weight_packed" not in sd:
                raise NVFP4Error(f"{key} has no {prefix}.weight_packed")
        else:
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def build_model(config: dict, state_dict: dict[str, Tensor], dtype: torch.dtype = _F32, where: str = "checkpoint"):
    """A transformers causal LM from a config.json dict (without quantization block) and a state dict in
    the serialized (Hugging Face hub) layout, converted as ``from_pretrained`` converts it (e.g. per-expert
    MoE tensors fused). A tensor the architecture needs but ``state_dict`` lacks is an error."""
    import transformers
    from transformers import AutoConfig

    raw = {k: v for k, v in config.items() if k != "quantization_config"}
    cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    archs = cfg.architectures or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    prev, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        model, info = cls.from_pretrained(None, config=cfg, state_dict=state_dict, dtype=dtype,
                                          output_loading_info=True)
    except Exception as e:  # conversion errors (e.g. a missing expert) come out as RuntimeError
        raise NVFP4Error(f"{where}: the weights do not load into {cls.__name__}: {e}") from e
    finally:
        transformers.logging.set_verbosity(prev)
        if bars:
            transformers.logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise NVFP4Error(f"{where}: tensors missing: {missing[:8]}")
    return model.eval()


def _experts_forward_w4a4(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers 5.x ``Qwen3MoeExperts.forward`` (eager loop over the hit experts, fused 3-D
    ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]) with each expert's gate/up input and down_proj
    input fake-quantized under that expert's ``input_global_scale`` (``self._w4a4_gate_up`` /
    ``self._w4a4_down``, float32 [E])."""
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = int(e[0])
        if e == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(mask[e])
        x = fake_quantize_activations(hidden_states[token_idx], self._w4a4_gate_up[e])
        gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        h = fake_quantize_activations(self.act_fn(gate) * up, self._w4a4_down[e])
        h = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


def install_activation_quantization(model, input_scales: dict[str, Tensor]) -> list:
    """Simulate the deployment's W4A4 activation quantization on a loaded (weights-dequantized) model.

    ``input_scales`` maps ``<module>.input_global_scale`` (export keys) to float32 [1]. Every
    ``nn.Linear`` with a scale gets a forward pre-hook that fake-quantizes its input; a fused MoE experts
    module (3-D ``gate_up_proj``/``down_proj``, keys ``<experts>.<e>.gate_proj|up_proj|down_proj``) gets
    ``_experts_forward_w4a4`` as its forward. Layers fused at serving time (q/k/v, gate/up) see one
    input and use one scale: the minimum over their ``fused_group`` (calibration gives them equal scales,
    as they read the same input). Returns the hook handles (``.remove()`` undoes a Linear hook); the
    experts modules are listed in ``model._w4a4_experts``. A scale naming no module is an error.
    """
    scales = {k[: -len(".input_global_scale")]: v.to(_F32).reshape(1) for k, v in input_scales.items()}
    shared: dict[str, Tensor] = {}
    for mod, g in scales.items():
        grp = fused_group(f"{mod}.weight")
        shared[grp] = torch.minimum(shared[grp], g) if grp in shared else g
    used: set[str] = set()
    handles, experts = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name in scales:
            g = shared[fused_group(f"{name}.weight")]
            handles.append(mod.register_forward_pre_hook(
                lambda m, args, _g=g: (fake_quantize_activations(args[0], _g), *args[1:])))
            used.add(name)
        elif getattr(getattr(mod, "gate_up_proj", None), "ndim", 0) == 3 \
                and getattr(getattr(mod, "down_proj", None), "ndim", 0) == 3:
            n = int(mod.gate_up_proj.shape[0])
            keys = [(f"{name}.{e}.gate_proj", f"{name}.{e}.up_proj", f"{name}.{e}.down_proj") for e in range(n)]
            if not any(k in scales for ks in keys for k in ks):
                continue
            missing = [k for ks in keys for k in ks if k not in scales]
            if missing:
                raise NVFP4Error(f"{name}: input_global_scale missing for {missing[:4]}")
            mod._w4a4_gate_up = torch.cat([shared[fused_group(f"{g}.weight")] for g, _, _ in keys])
            mod._w4a4_down = torch.cat([shared[fused_group(f"{d}.weight")] for _, _, d in keys])
            mod.forward = _experts_forward_w4a4.__get__(mod)  # instance attribute: bypasses the dispatcher
            experts.append(name)
            used.update(k for ks in keys for k in ks)
    unused = sorted(set(scales) - used)
    if unused:
        raise NVFP4Error(f"input_global_scale for modules the model does not have (or not Linear): {unused[:5]}")
    model._w4a4_experts = experts
    return handles


def load_nvfp4_model(path: str | PathLike, dtype: torch.dtype | str = _F32, device: str | torch.device = "cpu",
                     simulate_activations: bool = False):
    """(model, tokenizer) of a compressed-tensors NVFP4 export, weights dequantized to ``dtype``.

    ``simulate_activations=True`` (the deployment: ``LocalEngine.from_pretrained``) also installs the
    W4A4 activation quantization of an export that has ``input_global_scale`` tensors
    (``install_activation_quantization``), so the model computes the deployment's numerics; a W4A16
    export has none and is unaffected. The default (``False``: the trainer's ``load_policy``, e.g. the
    reference model of reference-model IS, "upcast deployment weights") loads the weights only and
    drops the activation scales. ``model._w4a4_hooks`` holds the installed hooks (empty list if none).

    The model is built from config.json without its ``quantization_config`` (transformers would
    otherwise hand it to its compressed-tensors quantizer) and filled with the dequantized weights;
    a tensor the architecture needs but the export lacks is an error, not a random initialisation.
    ``dtype="auto"`` uses the export's stored dtype (bf16).
    """
    from transformers import AutoTokenizer, GenerationConfig

    path = Path(path)
    if not (path / "config.json").exists():
        raise NVFP4Error(f"no export at {path} (config.json missing)")
    raw = json.loads((path / "config.json").read_text())
    qc = raw.pop("quantization_config", None) or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != FORMAT:
        raise NVFP4Error(f"{path}: expected a compressed-tensors {FORMAT} export, got quant_method="
                         f"{qc.get('quant_method')!r} format={qc.get('format')!r}")
    if dtype == "auto":
        dtype = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"))
    sd = open_safetensors_dir(path)  # read and dequantized a tensor at a time
    model = build_model(raw, dequantize_state_dict(sd, dtype), dtype, where=str(path))
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model = model.to(device).eval()
    act = {k: sd[k] for k in sd if k.endswith(".input_global_scale")}
    model._w4a4_hooks = install_activation_quantization(model, act) if simulate_activations and act else []
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
