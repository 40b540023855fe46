"""bf16 safetensors export: the interim deployment format until the NVFP4 export lands."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prodrl_pipelines.rl.checkpoint import atomic_directory, load_policy


def export_bf16(checkpoint_dir: Path, out_dir: Path) -> dict:
    """Cast a trainer checkpoint to bf16 and write it (with tokenizer) atomically to ``out_dir``.

    Non-finite weights are exported as they are and counted: the deployment gate rejects them.
    """
    model, tokenizer = load_policy(Path(checkpoint_dir), dtype=torch.float32)
    sd = model.state_dict()
    in_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    nonfinite = sum(int((~torch.isfinite(t)).sum()) for t in sd.values() if t.is_floating_point())
    max_rel_err = 0.0
    for t in sd.values():
        if t.is_floating_point() and t.numel():
            e = ((t.to(torch.bfloat16).float() - t).abs().max() / t.abs().max().clamp_min(1e-12)).item()
            if e == e:
                max_rel_err = max(max_rel_err, e)
    model = model.to(torch.bfloat16)
    with atomic_directory(Path(out_dir)) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "prodrl_export.json").write_text(json.dumps({"format": "bf16", "source": str(checkpoint_dir)}))
    out_bytes = sum(f.stat().st_size for f in Path(out_dir).glob("*.safetensors"))
    return {
        "export_dir": str(out_dir), "format": "bf16 safetensors (interim: NVFP4 export not implemented yet)",
        "fp32_bytes": in_bytes, "export_bytes": out_bytes, "compression_ratio": in_bytes / max(out_bytes, 1),
        "nonfinite_weights": nonfinite, "max_rel_rounding_error": max_rel_err,
    }
