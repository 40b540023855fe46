"""Deployable exports of a trainer checkpoint: NVFP4 (compressed-tensors, vLLM-loadable) or bf16.

``export_policy(src, dst, scheme)`` reads the checkpoint's safetensors (Hugging Face layout), refuses
anything it cannot export faithfully (unknown scheme, missing tensors, non-finite weights, NVFP4
input dimensions not divisible by 16) before writing a byte, and writes the export atomically:

- ``nvfp4-w4a16`` (default, data-free): every Linear weight as ``weight_packed`` / ``weight_scale`` /
  ``weight_global_scale`` (see ``quant.nvfp4``); lm_head, embeddings, norms and MoE router gates stay
  bf16 and are listed in the config's ``ignore``.
- ``nvfp4-w4a4``: the same weights plus ``input_global_scale`` per Linear from calibration on
  recorded prompts (token-id lists), activation amax taken on the W4-dequantized model (what is
  served); MoE experts are calibrated on every token (as llm-compressor's all-experts calibration).
- ``bf16``: every floating tensor cast to bf16.

config.json carries the ``quantization_config`` block vLLM reads; tokenizer files and the generation
config are copied alongside; ``prodrl_export.json`` records scheme, source and per-layer errors.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from collections import defaultdict
from os import PathLike
from pathlib import Path

import torch
from torch import Tensor

from prodrl_pipelines.atomic import atomic_directory
from prodrl_pipelines.quant import nvfp4
from prodrl_pipelines.quant.nvfp4 import NVFP4Error

__all__ = ["SCHEMES", "ExportError", "NonFiniteWeightsError", "export_policy", "export_nonfinite",
           "layer_error_png", "layer_error_markdown"]

SCHEMES = ("nvfp4-w4a16", "nvfp4-w4a4", "bf16")
MARKER = "prodrl_export.json"
SERVE_DTYPE = torch.bfloat16
MAX_SHARD_BYTES = 4 * 1024**3
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.json", "generation_config.json")
_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embeddings?|wte|wpe)$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


class ExportError(ValueError):
    """The checkpoint or the request cannot be exported; nothing was written."""


class NonFiniteWeightsError(ExportError):
    """Non-finite weights in the checkpoint; ``tensors`` maps each offending tensor to its count."""

    def __init__(self, msg: str, tensors: dict[str, int]):
        super().__init__(msg)
        self.tensors = tensors


# --------------------------------------------------------------------------------- reading

def _read_checkpoint(src: Path) -> tuple[dict, dict[str, Tensor]]:
    if not (src / "config.json").exists():
        raise ExportError(f"no checkpoint at {src} (config.json missing)")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ExportError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                          "export from the trainer checkpoint")
    try:
        sd = nvfp4.read_safetensors_dir(src)
    except NVFP4Error as e:
        raise ExportError(str(e)) from e
    bad = {k: int((~torch.isfinite(t)).sum()) for k, t in sd.items() if t.is_floating_point()}
    bad = {k: n for k, n in bad.items() if n}
    if bad:
        names = ", ".join(f"{k} ({n})" for k, n in list(bad.items())[:5])
        raise NonFiniteWeightsError(f"refusing to export {src}: non-finite weights in {len(bad)} tensor(s): {names}", bad)
    _check_experts(src, config, sd)
    return config, sd


def _check_experts(src: Path, config: dict, sd: dict[str, Tensor]) -> None:
    """Every MoE layer holds every expert's projections (named, not a concat error from transformers)."""
    n = config.get("num_experts") or config.get("num_local_experts")
    found: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for k in sd:
        m = _EXPERT.match(k)
        if m:
            found[m.group(1)][m.group(3)].add(int(m.group(2)))
    projs = {p for layer in found.values() for p in layer}
    missing = []
    for prefix, layer in sorted(found.items()):
        want = set(range(int(n))) if n else set().union(*layer.values())
        for p in sorted(projs):
            missing += [f"{prefix}.{e}.{p}.weight" for e in sorted(want - layer.get(p, set()))]
    if missing:
        raise ExportError(f"checkpoint {src} is missing tensors: {missing[:8]}" + (" ..." if len(missing) > 8 else ""))


def _source_model(src: Path, config: dict, sd: dict[str, Tensor]):
    """The fp32 model of the checkpoint: proves the checkpoint is complete for its architecture."""
    try:
        return nvfp4.build_model(config, {k: v.float() if v.is_floating_point() else v for k, v in sd.items()},
                                 torch.float32, where=f"checkpoint {src}")
    except NVFP4Error as e:
        raise ExportError(str(e)) from e


# --------------------------------------------------------------------------------- quantizing

def _rel_fro(ref: Tensor, approx: Tensor) -> float:
    ref = ref.double()
    den = float(ref.norm())
    return float((approx.double() - ref).norm()) / den if den > 0 else float((approx.double() - ref).norm())


def _quantize(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[dict], list[str]]:
    names = [k for k, t in sd.items() if nvfp4.quantizable(k, t)]
    bad = [f"{k} {tuple(sd[k].shape)}" for k in names if sd[k].shape[1] % nvfp4.GROUP_SIZE]
    if bad:
        raise ExportError(f"NVFP4 needs input dimensions divisible by {nvfp4.GROUP_SIZE}; not so for: "
                          + ", ".join(bad[:8]))
    groups: dict[str, list[str]] = defaultdict(list)
    for k in names:
        groups[nvfp4.fused_group(k)].append(k)
    gscale = {}
    for members in groups.values():
        g = torch.stack([nvfp4.global_scale(sd[k]) for k in members]).amin(0)  # fused: one shared scale
        gscale.update({k: g for k in members})
    out: dict[str, Tensor] = {}
    rows: list[dict] = []
    qset = set(names)
    for k, t in sd.items():
        if k in qset:
            try:
                q = nvfp4.quantize_nvfp4(t, gscale[k], name=k)
            except NVFP4Error as e:
                raise ExportError(str(e)) from e
            prefix = k[: -len(".weight")]
            out[f"{prefix}.weight_packed"] = q.packed
            out[f"{prefix}.weight_scale"] = q.scale
            out[f"{prefix}.weight_global_scale"] = q.global_scale
            rows.append({"name": k, "shape": list(t.shape), "format": "nvfp4",
                         "rel_fro_error": _rel_fro(t, q.dequantize()), "fused_group": nvfp4.fused_group(k)})
        else:
            out[k] = t.to(SERVE_DTYPE) if t.is_floating_point() else t
            if t.is_floating_point():
                rows.append({"name": k, "shape": list(t.shape), "format": "bf16",
                             "rel_fro_error": _rel_fro(t, out[k])})
    ignore = ["lm_head"] + sorted(
        k[: -len(".weight")] for k, t in sd.items()
        if k.endswith(".weight") and t.ndim == 2 and k not in qset and not _EMBEDDING.search(k[: -len(".weight")])
        and k != "lm_head.weight")
    return out, rows, ignore


def _calibrate(config: dict, packed_sd: dict[str, Tensor], prompts: list[list[int]], names: list[str]) -> dict[str, Tensor]:
    """``input_global_scale`` per quantized Linear from activation amax on the W4-dequantized model."""
    model = nvfp4.build_model(config, nvfp4.dequantize_state_dict(packed_sd, torch.float32), torch.float32,
                              where="the W4 export (calibration)")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    amax: dict[str, Tensor] = {}

    def _record(key: str, x: Tensor) -> None:
        a = x.detach().abs().amax().float()
        amax[key] = torch.maximum(amax[key], a) if key in amax else a

    hooks = []
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, _k=mname: _record(_k, a[0])))
        elif getattr(mod, "gate_up_proj", None) is not None and getattr(mod, "down_proj", None) is not None \
                and getattr(mod.gate_up_proj, "ndim", 0) == 3:
            def _experts(m, a, _k=mname):
                x = a[0].reshape(-1, a[0].shape[-1])
                for e in range(m.gate_up_proj.shape[0]):  # every token through every expert
                    _record(f"{_k}.{e}.gate_proj", x)
                    _record(f"{_k}.{e}.up_proj", x)
                    gate, up = torch.nn.functional.linear(x, m.gate_up_proj[e]).chunk(2, dim=-1)
                    _record(f"{_k}.{e}.down_proj", m.act_fn(gate) * up)
            hooks.append(mod.register_forward_pre_hook(_experts))
    try:
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                ids = [int(t) for t in p]
                if not ids or not all(0 <= t < vocab for t in ids):
                    raise ExportError(f"calibration prompt {i} is empty or has token ids outside [0, {vocab})")
                model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for k in names:
        mod = k[: -len(".weight")]
        if mod not in amax:
            raise ExportError(f"calibration never reached {mod}: cannot set its input_global_scale")
        out[f"{mod}.input_global_scale"] = nvfp4.global_scale(amax[mod])
    return out


# --------------------------------------------------------------------------------- writing

def _save_shards(tensors: dict[str, Tensor], out: Path, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t.contiguous()
        size += nb
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in sh})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def _copy_tokenizer(src: Path, dst: Path) -> None:
    if not ((src / "tokenizer.json").exists() or (src / "tokenizer_config.json").exists()):
        raise ExportError(f"{src} holds no tokenizer (tokenizer.json / tokenizer_config.json)")
    for f in src.iterdir():
        if f.is_file() and (f.name in _TOKENIZER_FILES or f.suffix == ".jinja"):
            shutil.copy2(f, dst / f.name)


def export_policy(src: str | PathLike, dst: str | PathLike, scheme: str = "nvfp4-w4a16",
                  calibration_prompts: list[list[int]] | None = None, *,
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Export the trainer checkpoint ``src`` to ``dst`` (replaced atomically) in ``scheme``.

    Returns the report: sizes, compression ratio against bf16, and per-tensor relative Frobenius
    error of what is served against the fp32 checkpoint. Raises ``ExportError`` (nothing written) for
    an unknown scheme, a checkpoint that is incomplete, non-finite weights (``NonFiniteWeightsError``,
    naming the tensors), NVFP4-incompatible shapes, or W4A4 without calibration prompts.
    """
    src, dst = Path(src), Path(dst)
    if scheme not in SCHEMES:
        raise ExportError(f"unknown export scheme {scheme!r}; choose one of {list(SCHEMES)}")
    if scheme == "nvfp4-w4a4" and not calibration_prompts:
        raise ExportError("scheme 'nvfp4-w4a4' needs calibration prompts (token-id lists) for input_global_scale")
    config, sd = _read_checkpoint(src)
    _source_model(src, config, sd)  # completeness check against the architecture
    src_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    bf16_bytes = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in sd.values())
    out_cfg = {k: v for k, v in config.items() if k != "torch_dtype"}
    out_cfg["dtype"] = "bfloat16"
    extra: dict = {}
    if scheme == "bf16":
        tensors = {k: t.to(SERVE_DTYPE) if t.is_floating_point() else t for k, t in sd.items()}
        rows = [{"name": k, "shape": list(t.shape), "format": "bf16", "rel_fro_error": _rel_fro(t, tensors[k])}
                for k, t in sd.items() if t.is_floating_point()]
        fmt = "bf16 safetensors"
    else:
        tensors, rows, ignore = _quantize(sd)
        qnames = [r["name"] for r in rows if r["format"] == "nvfp4"]
        if scheme == "nvfp4-w4a4":
            tensors.update(_calibrate(config, tensors, calibration_prompts, qnames))
            extra["calibration_prompts"] = len(calibration_prompts)
        out_cfg["quantization_config"] = nvfp4.quantization_config(scheme.split("-", 1)[1], ignore)
        fmt = f"compressed-tensors {nvfp4.FORMAT} ({scheme.split('-', 1)[1].upper()})"
        extra["ignore"] = ignore
    with atomic_directory(dst) as tmp:
        _save_shards(tensors, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True))
        _copy_tokenizer(src, tmp)
        (tmp / MARKER).write_text(json.dumps({"format": fmt, "scheme": scheme, "source": str(src), "layers": rows,
                                              **extra}, indent=1))
    export_bytes = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    q = [r["rel_fro_error"] for r in rows if r["format"] == "nvfp4"]
    return {
        "export_dir": str(dst), "scheme": scheme, "format": fmt, "source_bytes": src_bytes,
        "bf16_bytes": bf16_bytes, "export_bytes": export_bytes,
        "compression_ratio": bf16_bytes / max(export_bytes, 1),
        "compression_ratio_vs_source": src_bytes / max(export_bytes, 1),
        "quantized_tensors": len(q),
        "max_rel_fro_error": max(q) if q else max((r["rel_fro_error"] for r in rows), default=0.0),
        "mean_rel_fro_error": sum(q) / len(q) if q else float("nan"),
        "layers": rows, **extra,
    }


# --------------------------------------------------------------------------------- checking

def export_nonfinite(export_dir: str | PathLike) -> dict[str, int]:
    """Tensor name -> number of NaN/Inf entries of what the export serves: packed NVFP4 weights are
    dequantized (a bad scale or global scale shows up there), FP8 tensors upcast, the rest as stored.
    An export without weights has nothing to count (its smoke test fails instead)."""
    if not any(Path(export_dir).glob("*.safetensors")):
        return {}
    sd = nvfp4.read_safetensors_dir(export_dir)
    bad: dict[str, int] = {}
    for k, t in sd.items():
        if k.endswith(".weight_packed"):
            prefix = k[: -len(".weight_packed")]
            t = nvfp4.dequantize_nvfp4(t, sd[f"{prefix}.weight_scale"], sd[f"{prefix}.weight_global_scale"])
            k = f"{prefix}.weight"
        elif t.is_floating_point():
            t = t.float()
        else:
            continue
        n = int((~torch.isfinite(t)).sum())
        if n:
            bad[k] = n
    return bad


def layer_error_markdown(rows: list[dict], top: int = 40) -> str:
    """A markdown table of the per-tensor relative Frobenius errors (largest first)."""
    rows = sorted(rows, key=lambda r: -r["rel_fro_error"])[:top]
    lines = ["| tensor | shape | format | rel. Frobenius error |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | {'x'.join(map(str, r['shape']))} | {r['format']} | {r['rel_fro_error']:.4g} |"
              for r in rows]
    return "\n".join(lines)


def layer_error_png(rows: list[dict]) -> bytes:
    """Relative Frobenius error per tensor, in checkpoint order, NVFP4 and bf16 tensors coloured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    colours = ["tab:red" if r["format"] == "nvfp4" else "tab:gray" for r in rows]
    ax.bar(range(len(rows)), [max(r["rel_fro_error"], 1e-12) for r in rows], color=colours)
    ax.set_yscale("log")
    ax.set_xlabel("tensor (checkpoint order)")
    ax.set_ylabel("||W - deq(W)||_F / ||W||_F")
    ax.set_title("export error per tensor (red: NVFP4, grey: bf16)")
    ax.grid(alpha=0.3, axis="y")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
