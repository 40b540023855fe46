"""Lab text like production text: a byte-level BPE with real merges (a sampled non-canonical
segmentation does not round-trip) and a Qwen3-style template (earlier <think> blocks dropped, tool
calls re-serialised by the template)."""

from __future__ import annotations

import json

import pytest

from prodrl_pipelines.lab.production_text import (
    GLM45_STYLE_TOOLS_TEMPLATE, QWEN3_NOTHINK_STYLE_TOOLS_TEMPLATE, QWEN3_STYLE_TEMPLATE, QWEN3_STYLE_TOOLS_TEMPLATE, SPECIAL_TOKENS, build_byte_bpe_tokenizer, markup_as_text,
    non_canonical_split,
)


@pytest.fixture(scope="module")
def tok():
    return build_byte_bpe_tokenizer()


CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "12+30?"},
    {"role": "assistant", "content": "<think>\nI should call the tool.\n</think>\n\n",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}]},
    {"role": "tool", "content": '{"result": 42}'},
    {"role": "assistant", "content": "<think>\nThe tool said 42.\n</think>\n\n42"},
    {"role": "user", "content": "and +1?"},
    {"role": "assistant", "content": "<think>\n42+1\n</think>\n\n43"},
]


def test_the_template_drops_earlier_reasoning_and_keeps_the_current_turns(tok):
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n"
        "<|im_start|>user\n12+30?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"result": 42}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n42<|im_end|>\n"
        "<|im_start|>user\nand +1?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n42+1\n</think>\n\n43<|im_end|>\n"
    )
    # the history rewrite: what the engine saw and sampled at call k is no prefix of call k+1's prompt
    prompt_k = tok.apply_chat_template(CONVERSATION[:6], tokenize=False, add_generation_prompt=True)
    sampled = CONVERSATION[6]["content"] + "<|im_end|>"
    prompt_next = tok.apply_chat_template(CONVERSATION + [{"role": "user", "content": "thanks"}], tokenize=False,
                                          add_generation_prompt=True)
    assert not prompt_next.startswith(prompt_k + sampled)
    assert "<think>\n42+1" not in prompt_next  # dropped once a later user turn exists


def test_consecutive_tool_results_share_one_user_turn(tok):
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "a", "arguments": "{}"}}, {"function": {"name": "b", "arguments": "{}"}}]},
            {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\ngo<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_compact_tool_call_is_re_serialised_by_the_template(tok):
    """The model wrote its call compactly; the harness parses it into ``tool_calls`` and the template
    renders it with its own JSON formatting: the next prompt holds other ids than were sampled."""
    sampled_text = '<tool_call>\n{"name":"add","arguments":{"a":7,"b":5}}\n</tool_call>'
    sampled_ids = tok.encode(sampled_text, add_special_tokens=False)
    call = json.loads(sampled_text.split("\n")[1])
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "7+5"}, {"role": "assistant", "content": "", "tool_calls": [{"function": call}]}],
        tokenize=False)
    assert '{"name": "add", "arguments": {"a": 7, "b": 5}}' in rendered
    assert sampled_text not in rendered
    body = rendered.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    assert tok.encode(body, add_special_tokens=False) != sampled_ids


def test_merges_are_real_and_a_non_canonical_segmentation_does_not_round_trip(tok):
    for text in ("123", " answer", '{"result":', "answer"):
        assert len(tok.encode(text, add_special_tokens=False)) < len(text.encode()), text  # merged
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    for text in ("123+456=579", " the answer is 42", '{"a": 12}'):
        canonical = tok.encode(text, add_special_tokens=False)
        sampled = non_canonical_split(tok, text)  # what a model may sample: the same bytes, other tokens
        assert sampled != canonical and len(sampled) > len(canonical)
        decoded = tok.decode(sampled)
        assert decoded == text  # the text the recorder and a naive pipeline store ...
        assert tok.encode(decoded, add_special_tokens=False) == canonical != sampled  # ... retokenizes differently


def test_the_tokenizer_is_deterministic():
    a, b = build_byte_bpe_tokenizer(), build_byte_bpe_tokenizer()
    assert a.get_vocab() == b.get_vocab()


ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers: a long description "
                                                                      "the compact rendering leaves out.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                        "b": {"type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": None}}


def test_the_tools_template_renders_one_compact_line_per_tool_in_the_system_turn(tok):
    tools_tok = markup_as_text(tok)
    tools_tok.chat_template = QWEN3_STYLE_TOOLS_TEMPLATE
    text = tools_tok.apply_chat_template(CONVERSATION, tools=[ADD, NOW], tokenize=False)
    # the system message opens the tools turn (as Qwen3's template does), then the rest as without tools
    head = "<|im_start|>system\nYou add numbers.\n\n<tools>\nadd(a, b)\nnow()\n</tools><|im_end|>\n"
    assert text == head + tok.apply_chat_template(CONVERSATION[1:], tokenize=False)
    no_system = tools_tok.apply_chat_template(CONVERSATION[1:2], tools=[ADD], tokenize=False, add_generation_prompt=True)
    assert no_system == "<|im_start|>system\n<tools>\nadd(a, b)\n</tools><|im_end|>\n<|im_start|>user\n12+30?<|im_end|>\n" \
                        "<|im_start|>assistant\n"
    # a fraction of what Qwen3's template writes for the same tool (its JSON schema), in 256 positions
    assert 4 * len(tools_tok.encode("add(a, b)\n")) < len(tools_tok.encode(json.dumps(ADD)))
    for conv in (CONVERSATION, CONVERSATION[1:]):  # without tools: the template the task always had
        assert tools_tok.apply_chat_template(conv, tokenize=False) == tok.apply_chat_template(conv, tokenize=False)
    assert QWEN3_STYLE_TEMPLATE == tok.chat_template


def test_markup_as_text_keeps_the_ids_and_survives_skip_special_tokens(tok):
    text = '<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    as_text = markup_as_text(tok)
    assert as_text.encode(text, add_special_tokens=False) == ids and len(as_text) == len(tok)
    assert as_text.chat_template == tok.chat_template
    # an OpenAI server decodes with skip_special_tokens: the markup stays for its reply parser (Qwen3's
    # tokenizer has these as non-special added tokens); the byte BPE's own marks them special
    assert as_text.decode(ids, skip_special_tokens=True) == text.removeprefix("<|im_start|>").removesuffix("<|im_end|>")
    assert "<tool_call>" not in tok.decode(ids, skip_special_tokens=True)


def test_the_glm_and_no_thinking_mimics_break_the_prefix_their_own_way(tok):
    """GLM-4.5: the call re-serialised as key/value pairs (the rest as Qwen3's); Qwen3 with thinking
    off: an empty reasoning block in every generation prompt that no rendered history keeps."""
    tools_tok = markup_as_text(tok)
    tools_tok.chat_template = QWEN3_STYLE_TOOLS_TEMPLATE
    qwen3 = tools_tok.apply_chat_template(CONVERSATION, tools=[ADD], tokenize=False)
    tools_tok.chat_template = GLM45_STYLE_TOOLS_TEMPLATE
    glm = tools_tok.apply_chat_template(CONVERSATION, tools=[ADD], tokenize=False)
    hermes = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>'
    pairs = "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>12</arg_value>\n<arg_key>b</arg_key>\n<arg_value>30</arg_value>\n</tool_call>"
    assert hermes in qwen3 and glm == qwen3.replace(hermes, pairs)
    tools_tok.chat_template = QWEN3_NOTHINK_STYLE_TOOLS_TEMPLATE
    nothink = tools_tok.apply_chat_template(CONVERSATION[:2], tools=[ADD], tokenize=False, add_generation_prompt=True)
    assert nothink.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = tools_tok.apply_chat_template(CONVERSATION, tools=[ADD], tokenize=False)
    assert "<think>" not in history and history.endswith("<|im_start|>assistant\n43<|im_end|>\n")
