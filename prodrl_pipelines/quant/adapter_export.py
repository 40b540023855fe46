"""A LoRA round's deployable adapter: its PEFT files beside the round's export, and the base export it
adapts.

A LoRA round's export directory holds the merged weights in the deployment's scheme (what the
evaluation, the monitors and the whole-model targets read, as for a full round) and, in ``adapter/``,
the adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``: what vLLM's
``/v1/load_lora_adapter`` and ``--lora-modules`` read), with ``lora_base.json`` naming the base's
policy version and its export. The adapter targets (``deploy_targets.adapters``) serve the base
export once and load each round's adapter into it; the base export is built once, by the round that
made the base, and stays.

No torch here: the deploy targets read these files in the control plane.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ADAPTER_DIR = "adapter"
BASE_FILE = "lora_base.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
SERVED_AS = ("adapter", "merged")


class AdapterExportError(ValueError):
    """A LoRA export whose adapter or base export is missing or unreadable."""


def write_adapter_export(checkpoint_dir: str | Path, export_dir: str | Path, base_version: str,
                         base_export: str | Path, served_as: str = "adapter") -> dict:
    """Copy the checkpoint's adapter into ``export_dir`` and name its base; the adapter's bytes.
    ``served_as``: how the deployment serves it, ``adapter`` (an adapter target: base export + adapter)
    or ``merged`` (any other target: the export's merged weights); the evaluation and ``ref_is`` use
    the same form (``served_as_adapter``)."""
    if served_as not in SERVED_AS:
        raise AdapterExportError(f"served_as {served_as!r}: one of {SERVED_AS}")
    src, dst = Path(checkpoint_dir) / ADAPTER_DIR, Path(export_dir) / ADAPTER_DIR
    missing = [f for f in ADAPTER_FILES if not (src / f).is_file()]
    if missing:
        raise AdapterExportError(f"the LoRA checkpoint {checkpoint_dir} has no {missing} in {ADAPTER_DIR}/")
    if not (Path(base_export) / "config.json").is_file():
        raise AdapterExportError(f"the base export of {base_version} is missing at {base_export} (config.json): "
                                 "the adapter has nothing to be served on")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in ADAPTER_FILES:
        shutil.copyfile(src / f, tmp / f)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    (Path(export_dir) / BASE_FILE).write_text(json.dumps({"base_version": base_version, "served_as": served_as,
                                                          "base_export": str(Path(base_export).resolve())}))
    return {"adapter_bytes": adapter_bytes(export_dir), "lora_base_version": base_version,
            "lora_base_export": str(Path(base_export).resolve())}


def adapter_bytes(export_dir: str | Path) -> int:
    return sum((Path(export_dir) / ADAPTER_DIR / f).stat().st_size for f in ADAPTER_FILES)


def adapter_export(export_dir: str | Path) -> tuple[Path, str, Path] | None:
    """(the adapter, the base's policy version, the base export) of a LoRA round's export; None for a
    whole-model export. The base export is the recorded one, else ``exports_root / base_version`` beside
    this export (a host whose exports live elsewhere)."""
    d = Path(export_dir)
    if not (d / BASE_FILE).is_file():
        return None
    try:
        meta = json.loads((d / BASE_FILE).read_text())
        version, base = str(meta["base_version"]), Path(meta["base_export"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AdapterExportError(f"{d / BASE_FILE} is unreadable: {e}") from None
    if not base.is_absolute() or not (base / "config.json").is_file():
        sibling = d.parent / version  # exports_root / base_version, where this host keeps its exports
        base = sibling if (sibling / "config.json").is_file() else base
    missing = [f for f in ADAPTER_FILES if not (d / ADAPTER_DIR / f).is_file()]
    if missing:
        raise AdapterExportError(f"the LoRA export {d} has no {missing} in {ADAPTER_DIR}/")
    return d / ADAPTER_DIR, version, base


def served_as_adapter(export_dir: str | Path) -> bool:
    """Whether the deployment serves this export as base export + adapter (recorded at export time)."""
    f = Path(export_dir) / BASE_FILE
    try:
        return f.is_file() and json.loads(f.read_text()).get("served_as") == "adapter"
    except (OSError, ValueError):
        return False


def adapter_rank(export_dir: str | Path) -> int:
    """The rank ``r`` of a LoRA export's adapter (its ``adapter_config.json``)."""
    return int(json.loads((Path(export_dir) / ADAPTER_DIR / "adapter_config.json").read_text())["r"])
