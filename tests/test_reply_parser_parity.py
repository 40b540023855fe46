"""``prodrl serve --reply-parser qwen3`` against vLLM 0.32's own parsers (``QWEN3.vllm_args``: the qwen3
reasoning parser and the hermes tool-call parser): the same reasoning, content and tool calls for
each reply text of a table, non-streamed.

vLLM's answers come from its parser classes (``ParserManager.get_parser``, the composition its chat
endpoint builds, and ``Parser.parse``, what it calls on a finished choice), run in the vLLM venv in
one subprocess for the whole table. They parse text only: the tokenizer (a Qwen3-like one built
here, ``<think>`` and ``<tool_call>`` single tokens that are not special) only names the special
tokens vLLM would drop from the text, and none is in the table.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from prodrl_pipelines.engines.chat_tools import plan_tools, reply_message
from prodrl_pipelines.engines.reply_parsers import QWEN3
from tests.vllm_support import vllm_python

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = '{"name": "add", "arguments": {"a": 1}}'
OPEN_PROMPT = "<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n<think>\n"  # the template opened <think>

# (id, reply text, tool_choice, chat_template_kwargs, prompt the reply follows)
CASES = [
    ("think_answer", "<think>a</think>b", "auto", None, None),
    ("think_answer_qwen3_spacing", "<think>\n12+7\n</think>\n\n19", "auto", None, None),
    ("opened_in_prompt", "12+7\n</think>\n\n19", "auto", None, OPEN_PROMPT),
    ("opened_in_prompt_no_prompt_given", "12+7\n</think>\n\n19", "auto", None, None),
    ("no_think_tags", "19", "auto", None, None),
    ("no_think_tags_after_open_prompt", "19", "auto", None, OPEN_PROMPT),
    ("truncated_reasoning", "<think>\n12+", "auto", None, None),
    ("truncated_reasoning_opened_in_prompt", "12+", "auto", None, OPEN_PROMPT),
    ("truncated_mid_close_tag", "<think>a</thi", "auto", None, None),
    ("empty", "", "auto", None, None),
    ("empty_reasoning", "<think></think>b", "auto", None, None),
    ("empty_reasoning_newlines", "<think>\n\n</think>\n\n19", "auto", None, None),
    ("reasoning_only", "<think>a</think>", "auto", None, None),
    ("open_tag_only", "<think>", "auto", None, None),
    ("whitespace_around_content", "<think> a </think>  b  \n", "auto", None, None),
    ("whitespace_only_content", "<think>a</think>\n\n", "auto", None, None),
    ("whitespace_only", "\n\n", "auto", None, None),
    ("text_before_think", "x<think>a</think>b", "auto", None, None),
    ("second_open_in_reasoning", "<think><think>a</think>b", "auto", None, None),
    ("second_close_in_content", "<think>a</think>b</think>c", "auto", None, None),
    ("open_in_content", "<think>a</think>b<think>c", "auto", None, None),
    ("call_after_reasoning", f"<think>\n12+7\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>", "auto", None, None),
    ("two_calls", f"<think>a</think>\n\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
                  '{"name":"add","arguments":{}}\n</tool_call>', "auto", None, None),
    ("text_before_call", f"<think>a</think>\n\nso <tool_call>{CALL}</tool_call>", "auto", None, None),
    ("whitespace_before_call", f"<think>a</think> \n <tool_call>{CALL}</tool_call>", "auto", None, None),
    ("text_after_call", f"<think>a</think><tool_call>{CALL}</tool_call>\nthat's all", "auto", None, None),
    ("call_without_think", f"<tool_call>\n{CALL}\n</tool_call>", "auto", None, None),
    ("text_then_call_without_think", f"so <tool_call>{CALL}</tool_call>", "auto", None, None),
    ("call_inside_unclosed_reasoning", f"<think>\n12+7\n<tool_call>\n{CALL}\n</tool_call>", "auto", None, None),
    ("call_inside_reasoning_then_close", f"<think>a<tool_call>{CALL}</tool_call>b</think>c", "auto", None, None),
    ("call_before_reasoning", f"<tool_call>{CALL}</tool_call><think>a</think>b", "auto", None, None),
    ("unclosed_call", f"<think>a</think>\n\n<tool_call>\n{CALL}\n", "auto", None, None),
    ("truncated_call", '<think>a</think>\n\n<tool_call>\n{"name": "add", "argu', "auto", None, None),
    ("malformed_call", '<think>a</think>b<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "auto",
     None, None),
    ("one_good_one_malformed_call", f"<think>a</think><tool_call>{CALL}</tool_call><tool_call>{{</tool_call>",
     "auto", None, None),
    ("arguments_not_an_object", '<think>a</think><tool_call>{"name": "add", "arguments": "x"}</tool_call>', "auto",
     None, None),
    ("arguments_null", '<think>a</think><tool_call>{"name": "add", "arguments": null}</tool_call>', "auto", None,
     None),
    ("arguments_missing", '<think>a</think><tool_call>{"name": "add"}</tool_call>', "auto", None, None),
    ("name_not_a_string", '<think>a</think><tool_call>{"name": 5, "arguments": {}}</tool_call>', "auto", None,
     None),
    ("call_is_a_list", f"<think>a</think><tool_call>[{CALL}]</tool_call>", "auto", None, None),
    ("empty_call", "<think>a</think><tool_call></tool_call>", "auto", None, None),
    ("none_call_after_reasoning", f"<think>a</think>\n\n<tool_call>\n{CALL}\n</tool_call>", "none", None, None),
    ("none_call_inside_reasoning", f"<think>a<tool_call>{CALL}</tool_call>b</think>c", "none", None, None),
    ("none_no_think_tags", "19", "none", None, None),
    ("none_truncated_reasoning", "<think>\n12+", "none", None, None),
    ("none_empty_reasoning", "<think></think>\n\n19", "none", None, None),
    ("no_thinking_think_answer", "<think>a</think>b", "auto", {"enable_thinking": False}, None),
    ("no_thinking_plain", "19", "auto", {"enable_thinking": False}, None),
    ("no_thinking_empty", "", "auto", {"enable_thinking": False}, None),
    ("no_thinking_call", f"<think>\n\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>", "auto",
     {"enable_thinking": False}, None),
    ("no_thinking_none", f"so <tool_call>{CALL}</tool_call>", "none", {"enable_thinking": False}, None),
    ("thinking_explicitly_on", "19", "auto", {"enable_thinking": True}, None),
]

# run by the vLLM venv's interpreter: argv[1] the tokenizer, argv[2] the parser names, stdin the cases
VLLM_SCRIPT = r"""
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser import ParserManager

tok = AutoTokenizer.from_pretrained(sys.argv[1])
names = json.loads(sys.argv[2])
parser_cls = ParserManager.get_parser(tool_parser_name=names["tool"], reasoning_parser_name=names["reasoning"],
                                      enable_auto_tools=True)
out = []
for case in json.load(sys.stdin):
    kwargs = case["chat_template_kwargs"]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "12+7"}], tools=case["tools"],
                                tool_choice=case["tool_choice"], chat_template_kwargs=kwargs)
    parser = parser_cls(tok, req.tools, chat_template_kwargs=kwargs or {})
    if case["prompt"] is not None:  # as the chat endpoint does with the rendered prompt
        parser.set_prompt_token_ids(tok(case["prompt"], add_special_tokens=False)["input_ids"])
    reasoning, content, calls = parser.parse(case["text"], req, enable_auto_tools=True)
    out.append({"reasoning": reasoning, "content": content,
                "tool_calls": [[c.name, c.arguments] for c in calls or []]})
print("RESULTS " + json.dumps(out))
"""


def _flag(args: tuple[str, ...], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture(scope="module")
def vllm_answers(tmp_path_factory) -> dict[str, dict]:
    py = vllm_python()
    from prodrl_pipelines.lab.production_text import build_byte_bpe_tokenizer, markup_as_text

    tok_dir = tmp_path_factory.mktemp("qwen3_like_tokenizer")
    markup_as_text(build_byte_bpe_tokenizer()).save_pretrained(tok_dir)
    names = {"tool": _flag(QWEN3.vllm_args, "--tool-call-parser"),
             "reasoning": _flag(QWEN3.vllm_args, "--reasoning-parser")}
    cases = [{"text": text, "tools": [ADD], "tool_choice": choice, "chat_template_kwargs": kwargs, "prompt": prompt}
             for _, text, choice, kwargs, prompt in CASES]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([py, "-c", VLLM_SCRIPT, str(tok_dir), json.dumps(names)], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"vLLM's parsers failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    results = json.loads(lines[-1][len("RESULTS "):])
    return {case[0]: r for case, r in zip(CASES, results)}


def _ours(text: str, choice: str, kwargs: dict | None) -> dict:
    thinking = bool((kwargs or {}).get("enable_thinking", True))
    msg = reply_message(plan_tools({"tools": [ADD], "tool_choice": choice}, QWEN3), text, "stop",
                        thinking=thinking).message
    return {"reasoning": msg["reasoning"], "content": msg["content"],
            "tool_calls": [[c["function"]["name"], c["function"]["arguments"]] for c in msg.get("tool_calls") or []]}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_qwen3_reply_parser_splits_a_reply_as_vllm_does(vllm_answers, case):
    name, text, choice, kwargs, _prompt = case
    assert _ours(text, choice, kwargs) == vllm_answers[name], f"reply {text!r}, tool_choice {choice}, {kwargs}"
