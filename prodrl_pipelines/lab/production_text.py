"""Text that behaves like production text: a byte-level BPE tokenizer with real merges and a chat
template in the style of Qwen3's. The pieces the lab needs to reproduce why retokenized traces
differ from recorded ones (DESIGN.md s.9); the lab task ``arithmetic_tools`` speaks this text.

* ``build_byte_bpe_tokenizer``: byte-level BPE (GPT-2/Qwen style pre-tokenization: every byte has a
  token, merges learn multi-digit numbers, words with and without their leading space, JSON
  punctuation) trained locally with ``tokenizers`` on ``production_corpus()``. A model can sample a
  non-canonical segmentation of a string (``1`` ``2`` ``3`` where the merges make ``123`` one
  token); decoding it and encoding again gives the canonical ids, not the sampled ones.
* ``QWEN3_STYLE_TEMPLATE``: like Qwen3's template, assistant reasoning in ``<think>...</think>`` is
  kept in the current turn (after the last user message) and dropped from earlier turns; tool calls
  are rendered from structured ``tool_calls`` as ``<tool_call>{json}</tool_call>`` with the
  template's own JSON formatting (``tojson``: ``", "`` and ``": "`` separators), so a call the model
  wrote compactly is re-serialised differently next turn; tool results are wrapped in
  ``<tool_response>`` inside a user turn, consecutive results in one turn. It ignores ``tools``.
* ``QWEN3_STYLE_TOOLS_TEMPLATE``: the same, and it renders the tool definitions as Qwen3 does, in
  the system turn (after the system message, if any), but compactly, one ``name(param, ...)`` line
  each (``add(a, b)``): the lab model has 256 positions, and the JSON schema Qwen3 writes of one such
  tool takes 150-220 tokens of the ``arithmetic_tools`` tokenizer (the line: 17 with its ``<tools>``
  block, measured). Descriptions and types are left out.
* ``LLAMA32_STYLE_TOOLS_TEMPLATE``: the lab's markup (the same special tokens, so the same policy can
  be served with it) under Llama 3.2's rules for history: a system header dated at render time
  (``Today Date: {{ strftime_now("%d %b %Y") }}``, then the tools, then the system message; Llama's
  ``Cutting Knowledge Date`` line is left out: 30 of the lab model's 256 positions), assistant tool
  calls re-serialised from the parsed call as
  Llama's JSON ``{"name": ..., "parameters": ...}`` (no ``<tool_call>`` markup: not the model's own
  text) and reasoning dropped from every assistant turn. Tool results stay the lab's
  ``<tool_response>`` in a user turn (Llama's ``ipython`` turn would be a role the policy never saw).
"""

from __future__ import annotations

import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["GLM45_STYLE_TOOLS_TEMPLATE", "LLAMA32_STYLE_TOOLS_TEMPLATE", "QWEN3_NOTHINK_STYLE_TOOLS_TEMPLATE", "QWEN3_STYLE_TEMPLATE", "QWEN3_STYLE_TOOLS_TEMPLATE", "SPECIAL_TOKENS", "build_byte_bpe_tokenizer",
           "markup_as_text", "non_canonical_split", "production_corpus"]

PAD_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen3 has these as single added tokens, so the template's markup never splits.
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]

_QWEN3_STYLE_HEAD = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
)
# one compact line per tool: add(a, b)
_TOOL_LINES = (
    "{%- for t in tools -%}"
    "{%- set fn = t['function'] if 'function' in t else t -%}"
    "{%- set props = (fn.get('parameters') or {}).get('properties') or {} -%}"
    "{{- fn['name'] + '(' + props.keys() | join(', ') + ')\\n' -}}"
    "{%- endfor -%}"
)
# the tool definitions in the system turn, one compact line each: add(a, b)
_TOOLS_TURN = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '<tools>\\n' -}}"
    + _TOOL_LINES +
    "{{- '</tools><|im_end|>\\n' -}}"
    "{%- endif -%}"
)
# shared by the templates: consecutive tool results in one user turn, then the generation prompt
_TOOL_RESULTS_AND_PROMPT = (
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_QWEN3_STYLE_BODY = (
    "{%- for m in messages -%}"
    "{%- if m['role'] in ('system', 'user') -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] or '' -%}"
    "{%- set reasoning = m.get('reasoning_content') or '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query and reasoning -%}"
    # as Qwen3's: a server's reasoning and content keep the newlines around </think>
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- set content = content.lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- content -}}"
    "{%- for tc in m.get('tool_calls') or [] -%}"
    "{%- set fn = tc['function'] if 'function' in tc else tc -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{{- fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    + _TOOL_RESULTS_AND_PROMPT
)
QWEN3_STYLE_TEMPLATE = _QWEN3_STYLE_HEAD + _QWEN3_STYLE_BODY
# the system message, when tools are given, is rendered in the tools turn (skipped in the loop)
QWEN3_STYLE_TOOLS_TEMPLATE = _QWEN3_STYLE_HEAD + _TOOLS_TURN + _QWEN3_STYLE_BODY.replace(
    "{%- if m['role'] in ('system', 'user') -%}",
    "{%- if tools and loop.first and m['role'] == 'system' -%}"
    "{%- elif m['role'] in ('system', 'user') -%}", 1)
# GLM-4.5's rules in the lab's markup: earlier reasoning dropped (as Qwen3), and every call re-serialised
# as one <arg_key>/<arg_value> pair per argument, not the JSON object the model sampled
_HERMES_CALL = (
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{{- fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
)
_GLM_CALL = (
    "{{- '<tool_call>' + fn['name'] + '\\n' -}}"
    "{%- if fn['arguments'] is mapping -%}"
    "{%- for k, v in fn['arguments'].items() -%}"
    "{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>\\n' -}}"
    "{%- endfor -%}"
    "{%- else -%}{{- fn['arguments'] + '\\n' -}}{%- endif -%}"
    "{{- '</tool_call>' -}}"
)
GLM45_STYLE_TOOLS_TEMPLATE = QWEN3_STYLE_TOOLS_TEMPLATE.replace(_HERMES_CALL, _GLM_CALL, 1)
# Qwen3 with enable_thinking=False in the lab's markup: the generation prompt holds an empty reasoning
# block that no rendered history keeps, and earlier reasoning is never rendered
_EMPTY_THINK_PROMPT = "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}"
QWEN3_NOTHINK_STYLE_TOOLS_TEMPLATE = QWEN3_STYLE_TOOLS_TEMPLATE.replace(
    "{%- if loop.index0 > ns.last_query and reasoning -%}", "{%- if false -%}", 1).replace(
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{%- if add_generation_prompt -%}" + _EMPTY_THINK_PROMPT + "{%- endif -%}", 1)

# Llama 3.2's rules in the lab's markup: a dated system header, calls re-serialised, reasoning dropped
LLAMA32_STYLE_TOOLS_TEMPLATE = (
    "{%- set date_string = strftime_now('%d %b %Y') -%}"
    "{{- '<|im_start|>system\\nToday Date: ' + date_string + '\\n\\n' -}}"
    "{%- if tools -%}"
    "{{- '<tools>\\n' -}}"
    + _TOOL_LINES +
    "{{- '</tools>' -}}"
    "{%- endif -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- '\\n\\n' + messages[0]['content'] -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] == 'system' -%}"
    "{%- elif m['role'] in ('system', 'user') -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] or '' -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for tc in m.get('tool_calls') or [] -%}"
    "{%- set fn = tc['function'] if 'function' in tc else tc -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '{\"name\": \"' + fn['name'] + '\", \"parameters\": ' + fn['arguments'] | tojson + '}' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    + _TOOL_RESULTS_AND_PROMPT
)


def production_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Lab-like text with what real merges learn from: multi-digit numbers, words with and without
    a leading space, JSON tool calls and results, reasoning."""
    rng = random.Random(seed)
    words = ["the", "sum", "of", "is", "then", "add", "subtract", "result", "answer", "move", "check", "mate",
             "first", "so", "we", "get", "think", "next", "value", "total"]
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        w = rng.sample(words, 4)
        out += [
            f"{a}+{b}={a + b}",
            f"{w[0]} {w[1]} {w[2]} {a} and {b} {w[3]} {a + b}.",
            f'{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}',
            f'{{"name":"add","arguments":{{"a":{a},"b":{b}}}}}',
            f'{{"result": {a + b}}}',
            f"{w[0].capitalize()} {a} plus {b}: {w[3]} {a + b}",
        ]
    return out


def build_byte_bpe_tokenizer(vocab_size: int = 1024, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here (deterministic), with the template and Qwen's special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus or production_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=IM_END,
                                 additional_special_tokens=SPECIAL_TOKENS[1:], clean_up_tokenization_spaces=False,
                                 model_max_length=4096)
    hf.chat_template = QWEN3_STYLE_TEMPLATE
    return hf


def markup_as_text(tokenizer) -> PreTrainedTokenizerFast:
    """The same tokenizer (same ids) with the markup tokens (``<think>``, ``<tool_call>``, ...) as
    added tokens that are not special, as in Qwen3's tokenizer: decoding with
    ``skip_special_tokens`` (an OpenAI server's default) keeps them, so the server's reply parser
    sees the reasoning and the calls. ``build_byte_bpe_tokenizer`` marks them special (decoding with
    ``skip_special_tokens`` drops them), which the lab's engine-side decoding never asks for."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    for t in spec["added_tokens"]:
        if t["content"] in SPECIAL_TOKENS[3:]:
            t["special"] = False
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), pad_token=PAD_TOKEN,
                                 eos_token=IM_END, additional_special_tokens=[IM_START],
                                 clean_up_tokenization_spaces=False, model_max_length=tokenizer.model_max_length)
    hf.chat_template = tokenizer.chat_template
    return hf


def non_canonical_split(tokenizer, text: str) -> list[int]:
    """A segmentation of ``text`` a model can sample but the tokenizer would not produce: every
    multi-byte token of the canonical encoding split into single-byte tokens."""
    ids = []
    for t in tokenizer.encode(text, add_special_tokens=False):
        piece = tokenizer.convert_ids_to_tokens(t)
        ids += [tokenizer.convert_tokens_to_ids(ch) for ch in piece] if len(piece) > 1 else [t]
    return ids
