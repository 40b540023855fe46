"""Stand-in for your own model: a small Qwen3 (dense or MoE) from a config, a byte-level BPE tokenizer
trained with the `tokenizers` library, and a chat template of its own (roles as tags, tools as
JSON, its own end token). Random weights: it exercises the pipeline, it does not solve anything.

    python examples/own_model/build_model.py runs/their-qwen3 [--moe]
"""

from __future__ import annotations

import argparse
from pathlib import Path

END = "<|end|>"
SPECIAL = ["<|pad|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|system|>", "<|tools|>", END]
CHAT_TEMPLATE = (
    "{%- if tools %}<|tools|>{{ tools | tojson }}<|end|>{% endif -%}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)


def corpus() -> list[str]:
    words = ["the", "sum", "of", "and", "is", "move", "tool", "result", "answer", "yes", "no", "ok"]
    lines = []
    for i in range(400):
        a, b = i % 17, (i * 7) % 13
        lines.append(f"{a}+{b}={a + b} {words[i % len(words)]} {words[(i * 5) % len(words)]}")
    return lines


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token=END)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_model(path: Path, moe: bool = False, seed: int = 0) -> Path:
    """A random-init Qwen3 in ``path`` (head_dim 32, as vLLM's CPU attention needs) with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    vocab = ((len(tok) + 63) // 64) * 64  # embeddings padded past the tokenizer, as real models do
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                  tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=None)
    if moe:
        from transformers import Qwen3MoeConfig as Config

        cfg = Config(**common, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    else:
        from transformers import Qwen3Config as Config

        cfg = Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--moe", action="store_true")
    args = ap.parse_args()
    print(build_model(args.out, moe=args.moe))
