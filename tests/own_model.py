"""Someone else's model, built the way a user's would be, without the lab: a small Qwen3 (dense or MoE)
from a config, a byte-level BPE tokenizer trained with the `tokenizers` library, a chat template of
its own (roles as tags, tools rendered as JSON, its own end token), and a user package holding a
held-out JSONL grader and a multi-turn, tool-calling suite class."""

from __future__ import annotations

import json
import textwrap
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


GRADER = '''
"""A user's grader package: a JSONL reward function and a multi-turn, tool-calling suite."""
from dataclasses import dataclass


def reward(task, completions):
    if task.get("explode"):
        raise ValueError("grader cannot parse " + task["task_id"])
    return float(completions[-1].strip().startswith(task["answer"][:1]))


@dataclass(frozen=True)
class Task:
    task_id: str
    a: int
    b: int


class ToolSuite:
    """Two model calls: the model asks the calculator tool; the tool's result comes back; it answers."""
    name = "calculator"
    min_max_tokens = 2
    tools = ({"type": "function", "function": {"name": "add", "parameters": {"type": "object",
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},)

    def heldout_tasks(self, n):
        return [Task(f"calc-{i}", i % 7, i % 5) for i in range(min(n, 12))]

    def initial_messages(self, task):
        return [{"role": "system", "content": "use the add tool"}, {"role": "user", "content": f"{task.a}+{task.b}"}]

    def env_reply(self, task, turn, content):
        if turn == 0:
            return {"role": "tool", "content": str(task.a + task.b)}
        return None

    def reward(self, task, assistant_texts):
        assert len(assistant_texts) == 2, assistant_texts
        return 1.0 if str(task.a + task.b) in assistant_texts[-1] else 0.0
'''


def write_user_package(root: Path, n_tasks: int = 10, explode: tuple[int, ...] = ()) -> dict:
    """``root/mygrader/__init__.py`` and ``root/heldout.jsonl``; returns the settings that name them."""
    pkg = root / "mygrader"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(GRADER))
    lines = []
    for i in range(n_tasks):
        a, b = i % 9, (i * 3) % 7
        obj = {"task_id": f"q{i}", "messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        if i in explode:
            obj["explode"] = True
        lines.append(json.dumps(obj))
    (root / "heldout.jsonl").write_text("\n".join(lines) + "\n")
    return {"eval_suite": str(root / "heldout.jsonl"), "eval_reward_fn": "mygrader:reward"}
