"""A small BPE tokenizer trained locally on the lab's task text (no hub downloads).

Not byte-level: whitespace characters, digits and punctuation are each isolated into their own
pre-tokens (so every digit is its own token, which helps arithmetic), and BPE merges only letters
into words ("user", "assistant", "then"). The alphabet covers printable ASCII plus ``\\n``/``\\t``, so
any ASCII text round-trips exactly; decoding is plain concatenation.

Special tokens follow Qwen: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), and a
Qwen-style chat template ``<|im_start|>role\\ncontent<|im_end|>\\n`` with ``add_generation_prompt``.
"""

from __future__ import annotations

import string

from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:  # transformers is imported where a tokenizer is built: the token names are read without it
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
UNK_TOKEN = "<|unk|>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

DEFAULT_VOCAB_SIZE = 160
_ALPHABET = sorted(set(string.printable) - set("\x0b\x0c\r"))


def _corpus(task="arithmetic") -> list[str]:
    from prodrl_pipelines.lab.tasks import get_task

    roles = ["user", "assistant", "system", "tool"] * 50
    return roles + get_task(task).corpus_text()


def build_tokenizer(vocab_size: int | None = None, task="arithmetic") -> PreTrainedTokenizerFast:
    """Train the lab tokenizer of ``task`` (deterministic: fixed corpus, single-threaded-safe BPE trainer).

    ``vocab_size`` None: the task's own size (``TaskEnv.tokenizer_vocab_size``), else ``DEFAULT_VOCAB_SIZE``;
    the arithmetic tokenizer is exactly the one the lab always built.
    """
    from transformers import PreTrainedTokenizerFast

    from prodrl_pipelines.lab.tasks import get_task

    env = get_task(task)
    if env.build_tokenizer is not None:  # a task in production text brings its own
        return env.build_tokenizer()
    if vocab_size is None:
        vocab_size = env.tokenizer_vocab_size or DEFAULT_VOCAB_SIZE
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS + [UNK_TOKEN],
        initial_alphabet=_ALPHABET,
        limit_alphabet=len(_ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(task), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
