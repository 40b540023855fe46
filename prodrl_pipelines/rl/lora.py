"""LoRA policies (``recipe.training: lora``): PEFT adapters on the policy's linear layers, trained
while the base stays frozen.

W' = W + (alpha / r) B A for each adapted layer (A: r x in, B: out x r, B = 0 at the start, so the
adapted policy starts equal to the base). Only A and B train and the optimizer's state holds only
them (``build_optimizer`` takes the parameters that require gradients). The base policy is the
adapted model with its adapter off (``adapter_off``): no second model is loaded for it.

An MoE policy's experts are fused parameters, not ``nn.Linear`` layers, so ``all-linear`` adapts its
attention (and any dense layer); naming an expert projection is refused (``check_target_modules``):
PEFT cannot wrap it, and vLLM serves LoRA on MoE layers with GPU kernels only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

# what an MoE layer's fused experts are called (transformers 5's Qwen3-MoE): not adaptable here
EXPERT_PARAMETERS = ("gate_up_proj", "experts")


def check_target_modules(targets: tuple[str, ...]) -> None:
    """``lora_target_modules``: ``("all-linear",)`` or names of linear layers; an MoE expert projection is refused."""
    names = tuple(targets)
    if not names:
        raise ValueError("lora_target_modules: empty (use 'all-linear' or layer names such as q_proj)")
    bad = [n for n in names if n in EXPERT_PARAMETERS]
    if bad:
        raise ValueError(f"lora_target_modules={list(names)}: {bad} name MoE experts, which are fused parameters "
                         "(not linear layers): adapters go on attention and dense layers ('all-linear' does that)")


def lora_config(recipe):
    from peft import LoraConfig

    targets = tuple(recipe.lora_target_modules)
    return LoraConfig(r=recipe.lora_rank, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout,
                      target_modules="all-linear" if targets == ("all-linear",) else list(targets), bias="none")


def with_adapter(model, recipe, adapter_dir: str | Path | None = None):
    """``model`` (frozen) with a LoRA adapter: a fresh one (B = 0: the policy is the base), or the one
    saved at ``adapter_dir`` (a previous round's), trainable."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    return get_peft_model(model, lora_config(recipe))


def is_adapted(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def adapter_off(model):
    """The base policy: ``model``'s adapter disabled inside the block (a no-op for a plain model)."""
    if not is_adapted(model):
        yield model
        return
    with model.disable_adapter():
        yield model


def trainable_parameters(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def save_adapter(model, out_dir: str | Path) -> Path:
    """The adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``), what vLLM's
    ``/v1/load_lora_adapter`` and ``PeftModel.from_pretrained`` read."""
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out
