"""LoRA policies (``recipe.training: lora``): PEFT adapters on the policy's linear layers, trained
while the base stays frozen.

W' = W + (alpha / r) B A for each adapted layer (A: r x in, B: out x r, B = 0 at the start, so the
adapted policy starts equal to the base). Only A and B train and the optimizer's state holds only
them (``build_optimizer`` takes the parameters that require gradients). The base policy is the
adapted model with its adapter off (``adapter_off``): no second model is loaded for it.

In an MoE policy ``all-linear`` adapts attention (and any dense layer), not the experts or routers
(``adaptable_layers``): vLLM serves LoRA on MoE layers with GPU kernels only. Naming an expert or
router layer is refused, at load when the name is an expert projection (``check_target_modules``),
else when the policy is wrapped.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

# a LoRA round's checkpoint: the merged weights (what exports and evaluations read, as for a full
# round), its adapter in PEFT's format, and the policy version whose frozen weights it adapts: the
# layout of its export's adapter part too
from prodrl_pipelines.quant.adapter_export import ADAPTER_DIR, BASE_FILE

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


def _in_moe_block(name: str) -> bool:
    """A module of an MoE block's experts or router (``mlp.experts``, ``mlp.gate`` of a sparse block)."""
    return ".mlp.experts" in name or name.endswith(".mlp.gate") or ".mlp.gate." in name


def adaptable_layers(model) -> list[str]:
    """The linear layers ``all-linear`` adapts here: every ``nn.Linear`` but the output head and, in an
    MoE policy, the experts and routers (PEFT 0.21's own ``all-linear`` also wraps fused expert
    parameters and the router, which vLLM serves with GPU kernels only)."""
    import torch

    moe = any(".mlp.experts" in n for n, _ in model.named_modules())
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head") and not (moe and _in_moe_block(n))}
    return sorted(names)


def lora_config(recipe, model):
    from peft import LoraConfig

    targets = tuple(recipe.lora_target_modules)
    if targets == ("all-linear",):
        targets = tuple(adaptable_layers(model))
    else:
        moe_hits = sorted({t for t in targets for n, _ in model.named_modules()
                           if n.rsplit(".", 1)[-1] == t and _in_moe_block(n)})
        if moe_hits:
            raise ValueError(f"lora_target_modules {moe_hits}: MoE experts or routers in this policy; adapters go "
                             "on attention and dense layers (vLLM serves LoRA on MoE layers with GPU kernels only)")
    return LoraConfig(r=recipe.lora_rank, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout,
                      target_modules=list(targets), bias="none")


def with_adapter(model, recipe, adapter_dir: str | Path | None = None):
    """``model`` (frozen) with a LoRA adapter: a fresh one (B = 0: the policy is the base), or the one
    saved at ``adapter_dir`` (a previous round's), trainable."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    import torch

    # A's initial draw seeded by the recipe: every training rank (FSDP2 shards what each rank holds, so
    # they must hold the same) and every rerun of the round start from the same adapter
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(recipe.seed))
        return get_peft_model(model, lora_config(recipe, model))


def is_adapted(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def causal_lm(model):
    """The causal LM itself: a LoRA policy (a PEFT model) wraps it, its adapters injected in its layers."""
    return model.get_base_model() if is_adapted(model) else model


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


def adapter_of(checkpoint_dir: str | Path) -> tuple[Path | None, str | None]:
    """(the adapter, the base's policy version) of a LoRA round's checkpoint; (None, None) for a full one."""
    d = Path(checkpoint_dir)
    if not (d / BASE_FILE).exists():
        return None, None
    return d / ADAPTER_DIR, json.loads((d / BASE_FILE).read_text())["base_version"]


def merged_copy(model):
    """The adapted policy as a plain model (W + (alpha / r) B A folded into W), leaving ``model`` as it is."""
    import copy

    return copy.deepcopy(model).merge_and_unload()


def write_lora_parts(model, base_version: str):
    """What a LoRA round adds to its checkpoint directory (``save_checkpoint(extra=...)``)."""
    def write(directory: Path) -> None:
        save_adapter(model, Path(directory) / ADAPTER_DIR)
        (Path(directory) / BASE_FILE).write_text(json.dumps({"base_version": base_version}))

    return write


def served_policy(base_export: str | Path, adapter_dir: str | Path, dtype=None):
    """(model, tokenizer) of what an adapter target serves: the base export's weights as the trainer
    reads them (``load_policy``: NVFP4 dequantized) with the adapter folded in, W + (alpha / r) B A."""
    import torch

    from prodrl_pipelines.rl.checkpoint import load_policy

    model, tokenizer = load_policy(Path(base_export), dtype or torch.float32)
    return folded(model, adapter_dir), tokenizer


def folded(model, adapter_dir: str | Path):
    """``model`` (changed in place) with the PEFT adapter at ``adapter_dir`` folded into its weights."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
