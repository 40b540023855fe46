"""bf16 safetensors export (scheme ``bf16`` of ``quant.export.export_policy``)."""

from __future__ import annotations

from pathlib import Path


def export_bf16(checkpoint_dir: Path, out_dir: Path) -> dict:
    """Cast a trainer checkpoint to bf16 and write it (with tokenizer) atomically to ``out_dir``.

    Like every export, it refuses non-finite weights (``NonFiniteWeightsError`` names the tensors).
    """
    from prodrl_pipelines.quant.export import export_policy

    return export_policy(Path(checkpoint_dir), Path(out_dir), "bf16")
