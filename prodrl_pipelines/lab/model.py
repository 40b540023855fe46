"""The lab's tiny Qwen3-architecture causal LM, built from a config (no hub downloads).

The default is a tiny Qwen3-MoE (``Qwen3MoeForCausalLM``: 4 experts, top-2 routing, every layer
sparse), because engine/trainer mismatch is heavy-tailed on MoE models (routing flips). Measured on
the 2-core CPU box (fp32, one torch thread, SFT batch 64 x ~50 tokens): the MoE "demo" model costs
~95 ms per training step against ~77 ms for the dense equivalent (1.2-1.9x depending on batch and
load), learns the arithmetic task per step as fast as the dense one (held-out reward 0.18 vs 0.16
after 400 steps on a harder variant), and REINFORCE improves it as well as the dense one; the cost is
affordable, so MoE it is. ``arch="dense"`` (an override) builds ``Qwen3ForCausalLM`` instead.

Sizes:

- ``tiny``: for tests; builds and trains in a few seconds, success rate irrelevant.
- ``demo``: the default demo policy (~130k parameters); warm-starts in ~30 s on 2 CPU cores.
- ``tiny-dense``, ``demo-dense``: the same with a dense MLP (what vLLM can reload in place on CPU).

Attention heads are 32 wide (vLLM's CPU attention needs head_dim in {32, 64, 80, ...}): ``demo`` has
2 query heads and 1 key/value head of 32, the same projection widths (64 / 32) and parameter count
as the 4 x 16 / 2 x 16 heads it had before; ``tiny`` has one head of 32.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

_COMMON = dict(
    hidden_act="silu",
    max_position_embeddings=256,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
    attention_dropout=0.0,
    use_cache=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

SIZES: dict[str, dict] = {
    "tiny": dict(
        arch="moe",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "demo": dict(
        arch="moe",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
    ),
}
# the dense variants: the same sizes with one MLP per layer (Qwen3ForCausalLM); vLLM reloads these
# in place on CPU, and NVFP4 exports of them serve there (its NVFP4 MoE kernels are GPU-only)
SIZES.update({f"{name}-dense": {**spec, "arch": "dense"} for name, spec in list(SIZES.items())})


def lab_model_config(
    size: str = "demo",
    vocab_size: int = 128,
    *,
    pad_token_id: int = 0,
    eos_token_id: int = 2,
    bos_token_id: int | None = None,
    **overrides,
) -> Qwen3MoeConfig | Qwen3Config:
    """The transformers config of a lab model. ``overrides`` replace any size field (``arch="dense"``
    selects ``Qwen3ForCausalLM``)."""
    if size not in SIZES:
        raise ValueError(f"unknown lab model size {size!r}; choose one of {sorted(SIZES)}")
    spec = {**SIZES[size], **overrides}
    arch = spec.pop("arch")
    kw = dict(
        _COMMON,
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
    )
    if arch == "moe":
        return Qwen3MoeConfig(
            **kw,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
            **spec,
        )
    if arch == "dense":
        spec.pop("moe_intermediate_size", None)
        spec.pop("num_experts", None)
        spec.pop("num_experts_per_tok", None)
        return Qwen3Config(**kw, **spec)
    raise ValueError(f"unknown arch {arch!r}")


def build_model(config, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised fp32 causal LM for ``config``, deterministic in ``seed``."""
    cls = Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.to(torch.float32)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model
