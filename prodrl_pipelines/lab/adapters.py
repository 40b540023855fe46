"""LoRA round exports made without a round (tests, benches): an adapter with seeded random ``B`` on a
base policy (``B = 0``, a fresh adapter, would serve the base itself), exported as a LoRA round's
export is (``quant.adapter_export``): the merged weights, the adapter, and the base it adapts."""

from __future__ import annotations

import copy
from pathlib import Path


def random_adapter(model, recipe, scale: float, seed: int):
    """``model`` (left as it is) with a fresh adapter whose ``B`` is ``scale`` x a seeded normal draw."""
    import torch

    from prodrl_pipelines.rl import lora

    adapted = lora.with_adapter(copy.deepcopy(model), recipe)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in adapted.modules():
            if hasattr(mod, "lora_B") and "default" in mod.lora_B:
                w = mod.lora_B["default"].weight
                w.copy_(scale * torch.randn(w.shape, generator=gen, dtype=w.dtype))
    return adapted


def random_adapter_exports(base_checkpoint: str | Path, base_export: str | Path, root: str | Path,
                           scales: dict[str, float], base_version: str = "base", scheme: str = "bf16",
                           rank: int = 4, alpha: float = 8.0, served_as: str = "adapter") -> dict[str, Path]:
    """One LoRA export per name under ``root`` (adapter ``i`` seeded ``11 + i``), adapting the policy at
    ``base_checkpoint`` whose export ``base_export`` serves as ``base_version``."""
    from prodrl_pipelines.quant.adapter_export import write_adapter_export
    from prodrl_pipelines.quant.export import export_policy
    from prodrl_pipelines.rl import lora
    from prodrl_pipelines.rl.checkpoint import TrainerState, load_policy, save_checkpoint
    from prodrl_pipelines.rl.config import Recipe

    root = Path(root)
    base, tok = load_policy(Path(base_checkpoint))
    recipe = Recipe(training="lora", lora_rank=rank, lora_alpha=alpha)
    out = {}
    for i, (name, scale) in enumerate(scales.items()):
        model = random_adapter(base, recipe, scale, 11 + i)
        ckpt = root / f"{name}-checkpoint"
        save_checkpoint(ckpt, lora.merged_copy(model), tok, None, TrainerState(),
                        extra=lora.write_lora_parts(model, base_version))
        export_policy(ckpt, root / name, scheme)
        write_adapter_export(ckpt, root / name, base_version, base_export, served_as)
        out[name] = root / name
    return out
