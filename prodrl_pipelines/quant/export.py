"""Deployable exports of a trainer checkpoint: NVFP4 (compressed-tensors, vLLM-loadable) or bf16.

``export_policy(src, dst, scheme)`` reads the checkpoint's safetensors (Hugging Face layout), refuses
anything it cannot export faithfully (unknown scheme, missing tensors, non-finite weights, NVFP4
input dimensions not divisible by 16) before writing a byte, and writes the export atomically. It
streams: every tensor is read, checked, quantized, measured and written in row chunks
(``quant.safetensors_stream``), the architecture is checked on the meta device, so peak memory
follows a chunk, not the model (W4A4's calibration alone runs the whole served model):

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
import math
import re
import shutil
from collections import defaultdict
from os import PathLike
from pathlib import Path

import torch
from torch import Tensor

from prodrl_pipelines.storage.atomic import atomic_directory
from prodrl_pipelines.quant import nvfp4
from prodrl_pipelines.quant.nvfp4 import NVFP4Error
from prodrl_pipelines.quant.safetensors_stream import CheckpointReader, SafetensorsError, ShardedWriter

CHUNK_BYTES = 16 * 1024**2  # rows of a tensor read, checked, quantized and written at once

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

def _open_checkpoint(src: Path) -> tuple[dict, CheckpointReader, dict[str, Tensor]]:
    """The checkpoint's config and a reader of its tensors, checked a slice at a time: every tensor
    finite, every expert present, every tensor the architecture needs present with its shape."""
    if not (src / "config.json").exists():
        raise ExportError(f"no checkpoint at {src} (config.json missing)")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ExportError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                          "export from the trainer checkpoint")
    try:
        reader = CheckpointReader(src)
    except SafetensorsError as e:
        raise ExportError(str(e)) from e
    bad, amax = {}, {}
    for k, info in reader.tensors.items():  # one pass: non-finite counts, and the amax global scales need
        if info.dtype.is_floating_point:
            n, peaks = 0, []
            for c in reader.chunks(k, CHUNK_BYTES):
                n += int((~torch.isfinite(c)).sum())
                peaks.append(c.abs().amax())
            amax[k] = torch.stack(peaks).amax().reshape(1)
            if n:
                bad[k] = n
    if bad:
        names = ", ".join(f"{k} ({n})" for k, n in list(bad.items())[:5])
        raise NonFiniteWeightsError(f"refusing to export {src}: non-finite weights in {len(bad)} tensor(s): {names}", bad)
    _check_experts(src, config, reader.tensors)
    _check_architecture(src, config, reader)
    return config, reader, amax


def _check_experts(src: Path, config: dict, sd) -> None:
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


def _check_architecture(src: Path, config: dict, reader: CheckpointReader) -> None:
    """The checkpoint holds every tensor its architecture needs, with its shape: the model built on
    the meta device (no memory) and its state dict named as ``save_pretrained`` names it."""
    import transformers
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    raw = {k: v for k, v in config.items() if k != "quantization_config"}
    try:
        cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
        archs = cfg.architectures or []
        cls = getattr(transformers, archs[0], None) if archs else None
        cls = cls or transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
        with torch.device("meta"):
            model = cls(cfg)
        want = revert_weight_conversion(model, model.state_dict())
    except Exception as e:
        raise ExportError(f"checkpoint {src}: its config does not build a model: {e}") from e
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = sorted(k for k in want if k not in reader and k not in tied)
    if missing:
        raise ExportError(f"checkpoint {src}: the weights do not load into {cls.__name__}: tensors missing: {missing[:8]}")
    wrong = [f"{k} {reader.tensors[k].shape} (expected {tuple(t.shape)})" for k, t in want.items()
             if k in reader and reader.tensors[k].shape != tuple(t.shape)]
    if wrong:
        raise ExportError(f"checkpoint {src}: tensors of the wrong shape for {cls.__name__}: {wrong[:5]}")


# --------------------------------------------------------------------------------- quantizing

class _RelFro:
    """||approx - ref||_F / ||ref||_F accumulated over row chunks in float64 (a chunk's copy at a time)."""

    def __init__(self) -> None:
        self.err = self.ref = 0.0

    def add(self, ref: Tensor, approx: Tensor) -> None:
        r = ref.double()
        self.err += float((approx.double() - r).square().sum())
        self.ref += float(r.square().sum())

    @property
    def value(self) -> float:
        return math.sqrt(self.err) / math.sqrt(self.ref) if self.ref > 0 else math.sqrt(self.err)


def _cast_chunks(reader: CheckpointReader, name: str, err: _RelFro | None, keep: list | None):
    for c in reader.chunks(name, CHUNK_BYTES):
        out = c.to(SERVE_DTYPE) if c.is_floating_point() else c
        if err is not None:
            err.add(c, out)
        if keep is not None:
            keep.append(out)
        yield out


def _write_cast(reader: CheckpointReader, writer: ShardedWriter, name: str, rows: list[dict],
                keep: dict[str, Tensor] | None) -> None:
    """A tensor served as bf16 (integers as they are), with its error row."""
    info = reader.tensors[name]
    floating = info.dtype.is_floating_point
    err = _RelFro() if floating else None
    parts: list | None = [] if keep is not None else None
    writer.add(name, _cast_chunks(reader, name, err, parts),
               nbytes=math.prod(info.shape) * (2 if floating else info.dtype.itemsize))
    if keep is not None:
        keep[name] = torch.cat(parts) if parts[0].dim() else parts[0]
    if floating:
        rows.append({"name": name, "shape": list(info.shape), "format": "bf16", "rel_fro_error": err.value})


def _global_scales(amax: dict[str, Tensor], names: list[str]) -> dict[str, Tensor]:
    """Each quantized weight's global scale (``nvfp4.global_scale`` of the whole tensor, from its
    chunks' amax); layers fused at serving time share the smallest of theirs."""
    groups: dict[str, list[str]] = defaultdict(list)
    for k in names:
        groups[nvfp4.fused_group(k)].append(k)
    out = {}
    for members in groups.values():
        g = torch.stack([nvfp4.global_scale(amax[k]) for k in members]).amin(0)
        out.update({k: g for k in members})
    return out


def _write_quantized(reader: CheckpointReader, writer: ShardedWriter, name: str, gscale: Tensor, rows: list[dict],
                     keep: dict[str, Tensor] | None) -> None:
    """One Linear weight as NVFP4, quantized row chunk by row chunk (block scales are per row, the
    global scale is the tensor's): identical bytes to quantizing it whole."""
    prefix = name[: -len(".weight")]
    scales, err, deq = [], _RelFro(), []

    def packed():
        for c in reader.chunks(name, CHUNK_BYTES):
            try:
                q = nvfp4.quantize_nvfp4(c, gscale, name=name)
            except NVFP4Error as e:
                raise ExportError(str(e)) from e
            d = q.dequantize()
            err.add(c, d)
            if keep is not None:
                deq.append(d)
            scales.append(q.scale)
            yield q.packed

    info = reader.tensors[name]
    writer.add(f"{prefix}.weight_packed", packed(), nbytes=math.prod(info.shape) // 2)
    writer.add(f"{prefix}.weight_scale", scales)
    writer.add(f"{prefix}.weight_global_scale", [gscale.to(torch.float32).reshape(1).clone()])
    if keep is not None:
        keep[name] = torch.cat(deq)
    rows.append({"name": name, "shape": list(info.shape), "format": "nvfp4", "rel_fro_error": err.value,
                 "fused_group": nvfp4.fused_group(name)})


def _quantizable(reader: CheckpointReader) -> list[str]:
    names = [k for k, info in reader.tensors.items() if nvfp4.quantizable(k, info.meta())]
    bad = [f"{k} {reader.tensors[k].shape}" for k in names if reader.tensors[k].shape[1] % nvfp4.GROUP_SIZE]
    if bad:
        raise ExportError(f"NVFP4 needs input dimensions divisible by {nvfp4.GROUP_SIZE}; not so for: "
                          + ", ".join(bad[:8]))
    return names


def _ignore_list(reader: CheckpointReader, qset: set[str]) -> list[str]:
    return ["lm_head"] + sorted(
        k[: -len(".weight")] for k, info in reader.tensors.items()
        if k.endswith(".weight") and len(info.shape) == 2 and k not in qset
        and not _EMBEDDING.search(k[: -len(".weight")]) and k != "lm_head.weight")


def _calibrate(config: dict, served: dict[str, Tensor], prompts: list[list[int]], names: list[str]) -> dict[str, Tensor]:
    """``input_global_scale`` per quantized Linear from activation amax on the W4-dequantized model
    (``served``: what the export serves, dequantized; the one step that holds the whole model)."""
    model = nvfp4.build_model(config, {k: v.float() for k, v in served.items()}, torch.float32,
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
    config, reader, amax = _open_checkpoint(src)
    infos = reader.tensors.values()
    src_bytes = sum(i.nbytes for i in infos)
    bf16_bytes = sum(i.nbytes // i.dtype.itemsize * (2 if i.dtype.is_floating_point else i.dtype.itemsize)
                     for i in infos)
    out_cfg = {k: v for k, v in config.items() if k != "torch_dtype"}
    out_cfg["dtype"] = "bfloat16"
    extra: dict = {}
    rows: list[dict] = []
    qnames = [] if scheme == "bf16" else _quantizable(reader)
    gscales = _global_scales(amax, qnames)
    served: dict[str, Tensor] | None = {} if scheme == "nvfp4-w4a4" else None  # calibration runs the model
    with atomic_directory(dst) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for k in reader:  # one tensor, and one chunk of it, at a time
            if k in gscales:
                _write_quantized(reader, writer, k, gscales[k], rows, served)
            else:
                _write_cast(reader, writer, k, rows, served)
        if scheme == "bf16":
            fmt = "bf16 safetensors"
        else:
            if scheme == "nvfp4-w4a4":
                for k, t in _calibrate(config, served, calibration_prompts, qnames).items():
                    writer.add(k, [t])
                served = None
                extra["calibration_prompts"] = len(calibration_prompts)
            ignore = _ignore_list(reader, set(qnames))
            out_cfg["quantization_config"] = nvfp4.quantization_config(scheme.split("-", 1)[1], ignore)
            fmt = f"compressed-tensors {nvfp4.FORMAT} ({scheme.split('-', 1)[1].upper()})"
            extra["ignore"] = ignore
        writer.close()
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
    sd = nvfp4.open_safetensors_dir(export_dir)  # a tensor at a time
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
