"""Tools through `prodrl serve` (``engines.chat_tools``, ``chat_endpoint``) and the recorder: vLLM's
validation, the template's view of tools and tool results, the reply as an assistant message, forced
tool choices, streaming through the official openai client, and a tool-using conversation recorded.

The tiny test model does not write tool calls. ``ScriptedEngine`` (the local engine's interface)
answers with the text a tool-calling policy writes, keyed by how the prompt ends; everything after
the engine (rendering, parsing, streaming, recording) is the real server's and recorder's. The
forced-choice test also runs the real tiny model.
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest

from prodrl_pipelines.engines.chat_tools import (
    ToolPlan, forced_opening, normalize_messages, plan_tools, reply_message,
)
from prodrl_pipelines.engines.openai_protocol import ProtocolError
from prodrl_pipelines.engines.reply_parsers import QWEN3, reply_parser_flags
from prodrl_pipelines.engines.server import BackgroundServer, build_app
from prodrl_pipelines.engines.types import CallRecord, SamplingParams
from prodrl_pipelines.lab.production_text import QWEN3_STYLE_TEMPLATE, build_byte_bpe_tokenizer
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app

EOS = 2
TOKEN = "rec-token"
# a Qwen3-style template (reasoning kept in the current turn only, calls re-serialised, tool results
# in <tool_response>) that also renders the tool definitions, compactly (the tiny model has 256 positions)
TEMPLATE = ("{%- if tools -%}{{- '<|im_start|>system\\n' -}}{%- for t in tools -%}"
            "{{- t['function']['name'] + ': ' + (t['function']['description'] or '-') + '\\n' -}}{%- endfor -%}"
            "{{- '<|im_end|>\\n' -}}{%- endif -%}") + QWEN3_STYLE_TEMPLATE
ADD = {"type": "function", "function": {"name": "add", "description": "add a number",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}
CALLS = ('<think>\n12+7\n</think>\n\n<tool_call>\n{"name":"add","arguments":{"a":19}}\n</tool_call>\n'
         '<tool_call>\n{"name": "mul", "arguments": {"a": 2}}\n</tool_call>')
ANSWER = "<think>\n19-3\n</think>\n\n16"
NAMED = {"type": "function", "function": {"name": "mul"}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_policy_dir, tmp_path_factory):
    """The tiny policy with a chat template that renders tools, tool calls and tool results."""
    out = tmp_path_factory.mktemp("tools") / "policy"
    shutil.copytree(tiny_policy_dir, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


class ScriptedEngine:
    """The local engine's interface, answering a tool-using conversation's script (module docstring)."""

    def __init__(self, engine) -> None:
        self.model, self.tokenizer, self.vocab_size = engine.model, engine.tokenizer, engine.vocab_size

    @staticmethod
    def reply(prompt: str) -> str:
        if prompt.endswith(QWEN3.opening(None)):  # a forced call: the model writes the rest
            return 'add", "arguments": {"a": 19}}\n</tool_call>'
        if prompt.endswith('"arguments": '):
            return '{"a": 2}}\n</tool_call>'
        return ANSWER if "<tool_response>" in prompt else CALLS

    def generate(self, prompts, params: SamplingParams, seed=None) -> list[CallRecord]:
        out = []
        k = params.num_top_logprobs
        for p in prompts:
            ids = list(self.tokenizer(self.reply(self.tokenizer.decode(p)), add_special_tokens=False)["input_ids"])
            ids, finish = (ids + [EOS], "stop") if len(ids) < params.max_tokens else (ids[: params.max_tokens], "length")
            heads = [[t] + [x for x in range(k + 1) if x != t][: k - 1] for t in ids]
            out.append(CallRecord(list(p), ids, [-0.1] * len(ids), heads, [[-0.1] + [-5.0 - j for j in range(k - 1)]
                                                                            for _ in ids], False, finish_reason=finish))
        return out


@pytest.fixture(scope="module")
def scripted(engine, model_dir):
    app = build_app(ScriptedEngine(engine), model_dir=model_dir, served_model_name="v0", batch_wait_ms=1,
                    reply_parser="qwen3")
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain(engine, model_dir):
    """The real tiny model without a reply parser."""
    with BackgroundServer(build_app(engine, model_dir=model_dir, served_model_name="v0", batch_wait_ms=1)) as srv:
        yield srv


def _client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "x"), max_retries=0, timeout=60, **kw)


def _chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


# ----------------------------------------------------------------------------- validation


USER = [{"role": "user", "content": "12+7"}]


@pytest.mark.parametrize("body,needle", [
    ({"tools": []}, "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely."),
    ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": [ADD], "tool_choice": "sometimes"},
     'Invalid value for `tool_choice`: sometimes! Only named tools, "none", "auto" or "required" are supported.'),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "div"}}},
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ({"tools": [ADD], "tool_choice": {"type": "function"}},
     'Invalid value for `function`: `None` in `tool_choice`! Correct usage: `{"type": "function", "function": '
     '{"name": "my_function"}}`'),
    ({"tools": [ADD], "tool_choice": {"function": {}}}, "Expected field `name` in `function` in `tool_choice`!"),
    ({"tools": [ADD], "tool_choice": {"function": {"name": ""}}}, "Invalid `name` in `function`: `` in `tool_choice`!"),
    ({"tools": 5}, "tools: Input should be a valid list"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type: Input should be 'function'"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls: Input should be a valid boolean"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": 3}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": "add"}]}]},
     "messages.0.tool_calls.0.function"),
])
def test_bad_tool_requests_are_answered_with_vllms_messages(scripted, body, needle):
    r = _chat(scripted.url, {"messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_without_a_reply_parser_only_tool_choice_none_is_served(plain):
    for choice in ("auto", "required", NAMED):
        body = {"messages": USER, "max_tokens": 4, "tools": [ADD, MUL]}
        if choice != "auto":  # auto: the default with tools, as in vLLM
            body["tool_choice"] = choice
        r = _chat(plain.url, body)
        assert r.status_code == 400 and "--reply-parser" in r.json()["error"]["message"], r.text
    ok = _chat(plain.url, {"messages": USER, "max_tokens": 4, "tools": [ADD], "tool_choice": "none",
                           "return_prompt_text": True}).json()
    assert ok["prompt_text"].startswith("<|im_start|>system\nadd: add a number\n")  # tools still rendered (vLLM)
    assert "tool_calls" not in ok["choices"][0]["message"]


# ----------------------------------------------------------------------------- rendering


def test_the_template_renders_tools_assistant_calls_reasoning_and_tool_results(scripted, engine):
    messages = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "12+7",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":19}'}},
                        {"id": "c2", "type": "function", "function": {"name": "mul", "arguments": "{oops"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
        {"role": "tool", "tool_call_id": "c2", "name": "mul", "content": "ok"},
    ]
    out = _chat(scripted.url, {"messages": messages, "tools": [ADD, MUL], "max_tokens": 1,
                               "return_prompt_text": True, "return_token_ids": True}).json()
    assert "prompt_text" in out, out
    text = out["prompt_text"]
    assert text == (
        "<|im_start|>system\nadd: add a number\nmul: -\n<|im_end|>\n<|im_start|>user\n12+7<|im_end|>\n"
        # reasoning echoed as reasoning_content: kept after the last user turn; arguments parsed from the
        # JSON string and re-serialised by the template; a malformed string becomes {} (vLLM)
        "<|im_start|>assistant\n<think>\n12+7\n</think>\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
        "{\"a\": 19}}\n</tool_call>\n<tool_call>\n{\"name\": \"mul\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert out["prompt_token_ids"] == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    norm = normalize_messages(messages)
    assert norm[1]["reasoning"] == norm[1]["reasoning_content"] == "12+7"
    assert norm[1]["tool_calls"][0]["function"]["arguments"] == {"a": 19}
    assert norm[2] == {"role": "tool", "content": "ok", "tool_call_id": "c1"}
    assert norm[3]["name"] == "mul"
    assert "tool_calls" not in normalize_messages([{"role": "assistant", "content": "x", "tool_calls": []}])[0]


# ----------------------------------------------------------------------------- the reply


def _plan(choice="auto", parallel=True, fmt=QWEN3) -> ToolPlan:
    fields = {"tools": [ADD, MUL], "tool_choice": choice}
    if not parallel:
        fields["parallel_tool_calls"] = False
    return plan_tools(fields, fmt)


def test_the_reply_becomes_the_assistant_message():
    auto = reply_message(_plan(), CALLS, "stop")
    msg = auto.message
    assert auto.finish_reason == "tool_calls" and auto.parsed
    # vLLM's qwen3 parser keeps the newlines around </think> (the template strips them)
    assert msg["content"] is None and msg["reasoning"] == msg["reasoning_content"] == "\n12+7\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("add", {"a": 19}), ("mul", {"a": 2})]
    ids = [c["id"] for c in msg["tool_calls"]]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 2
    assert reply_message(_plan(), CALLS, "stop").message["tool_calls"][0]["id"] not in ids  # fresh per reply
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"a": 19}'  # re-serialised, as vLLM's parser

    one = reply_message(_plan(parallel=False), CALLS, "stop").message["tool_calls"]
    assert [c["function"]["name"] for c in one] == ["add"]  # parallel_tool_calls false: the first call only

    required = reply_message(_plan("required"), 'add", "arguments": {"a": 1}}\n</tool_call>', "stop",
                             QWEN3.opening(None))
    assert required.finish_reason == "tool_calls" and required.message["tool_calls"][0]["function"]["name"] == "add"
    named = reply_message(_plan(NAMED), '{"a": 2}}\n</tool_call>', "stop", QWEN3.opening("mul"))
    assert named.finish_reason == "stop"  # vLLM: a named function keeps the engine's reason
    assert named.message["tool_calls"][0]["function"] == {"name": "mul", "arguments": '{"a": 2}'}

    cut = reply_message(_plan("required"), 'add", "argu', "length", QWEN3.opening(None))
    assert cut.finish_reason == "length" and "tool_calls" not in cut.message  # did not parse: content
    assert cut.message["content"] == QWEN3.opening(None) + 'add", "argu'

    none = reply_message(_plan("none"), CALLS, "stop")  # reasoning parsed, calls left in the content
    assert none.finish_reason == "stop" and "tool_calls" not in none.message
    assert none.message["reasoning"] == "\n12+7\n" and none.message["content"].startswith("\n\n<tool_call>")

    text = reply_message(_plan(), ANSWER, "stop")
    assert (text.message["content"], text.message["reasoning"], text.finish_reason) == ("\n\n16", "\n19-3\n", "stop")
    raw = reply_message(plan_tools({}, None), CALLS, "stop")  # no parser: the text as it was sampled
    assert raw.message["content"] == CALLS and raw.message["reasoning"] is None and not raw.parsed
    # no </think> (cut mid-thought, or the template opened <think>): all reasoning, as vLLM's qwen3 parser
    cut = reply_message(_plan(), "12+", "length")
    assert cut.message["content"] is None and cut.message["reasoning"] == "12+" and cut.parsed
    # enable_thinking false: vLLM parses no reasoning
    plain = reply_message(_plan(), "16", "stop", thinking=False)
    assert plain.message["content"] == "16" and plain.message["reasoning"] is None and not plain.parsed
    assert reply_message(_plan("none"), ANSWER, "stop", thinking=False).message["content"] == ANSWER


def test_forced_openings_end_on_a_pre_tokenizer_boundary(engine):
    prompt = "<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n"
    byte_bpe = build_byte_bpe_tokenizer()
    for tok, named in ((engine.tokenizer, QWEN3.opening("mul")),  # spaces are pieces of their own: kept
                       (byte_bpe, QWEN3.opening("mul").rstrip(" "))):  # " {" is one piece: the space is the model's
        def enc(s):
            return tok(s, add_special_tokens=False)["input_ids"]

        for choice, want in (("required", QWEN3.opening(None)), (NAMED, named)):
            plan = _plan(choice)
            opening = forced_opening(plan, tok, prompt)
            assert opening == want
            whole = QWEN3.call_text(plan.function or "add", {"a": 19})
            assert enc(prompt + whole)[: len(enc(prompt + opening))] == enc(prompt + opening)
        assert forced_opening(_plan("auto"), tok, prompt) == ""


# ----------------------------------------------------------------------------- through the server


def test_a_streamed_tool_call_is_the_non_streamed_message(scripted):
    client = _client(scripted.url)
    kw = dict(model="v0", messages=USER, tools=[ADD, MUL], max_tokens=140, seed=1,
              extra_body={"return_token_ids": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    with client.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    want = full.choices[0]
    assert want.finish_reason == "tool_calls" and want.message.content is None
    assert want.message.model_extra["reasoning"] == "\n12+7\n"
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert sum((d.model_extra["token_ids"] for d in deltas[1:]), []) == want.model_extra["token_ids"]
    assert len(deltas) == len(want.model_extra["token_ids"]) + 1  # one chunk per token after the role chunk
    assert all(d.delta.tool_calls is None and d.delta.content is None for d in deltas[1:-1])  # parts come last
    last = deltas[-1]
    assert [(t.index, t.id.startswith("chatcmpl-tool-"), t.function.name) for t in last.delta.tool_calls] == \
        [(0, True, "add"), (1, True, "mul")]
    assert last.finish_reason == "tool_calls" and last.delta.model_extra["reasoning"] == "\n12+7\n"
    got = final.choices[0]
    assert got.finish_reason == want.finish_reason and (got.message.content or None) == want.message.content
    assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls] == \
        [(t.function.name, t.function.arguments) for t in want.message.tool_calls]
    assert got.message.model_extra.get("reasoning") == "\n12+7\n"
    # a reply with nothing parsed (enable_thinking false: no reasoning parsed) still streams token by token
    body = {"messages": USER, "max_tokens": 5, "stream": True, "tools": [ADD], "tool_choice": "none"}
    text = _chat(scripted.url, {**body, "chat_template_kwargs": {"enable_thinking": False}})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.text.splitlines()
              if line.startswith("data: {") and '"delta"' in line]
    assert len([d for d in deltas[1:] if d.get("content")]) > 1
    # thinking on, the same reply cut before </think> is reasoning (vLLM's qwen3 parser), whole with the last token
    text = _chat(scripted.url, body)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.text.splitlines()
              if line.startswith("data: {") and '"delta"' in line]
    assert [bool(d.get("reasoning")) for d in deltas[1:]] == [False] * (len(deltas) - 2) + [True]
    assert not any(d.get("content") for d in deltas[1:])


def test_a_required_call_is_opened_in_the_prompt_and_parses(scripted, plain, engine, model_dir):
    tok = engine.tokenizer
    body = {"messages": USER, "tools": [ADD, MUL], "tool_choice": "required", "max_tokens": 40, "seed": 3,
            "return_token_ids": True, "return_prompt_text": True}
    out = _chat(scripted.url, body).json()
    rendered = tok.apply_chat_template(USER, tools=[ADD, MUL], tokenize=False, add_generation_prompt=True)
    opening = QWEN3.opening(None)
    assert out["prompt_text"] == rendered + opening
    enc = tok(rendered, add_special_tokens=False)["input_ids"]
    assert out["prompt_token_ids"] == enc + tok(opening, add_special_tokens=False)["input_ids"]
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"]["tool_calls"]] == \
        [("add", '{"a": 19}')]
    assert tok.decode(ch["token_ids"][:-1]) == 'add", "arguments": {"a": 19}}\n</tool_call>'  # only what was sampled
    named = _chat(scripted.url, {**body, "tool_choice": NAMED}).json()
    assert named["prompt_text"].endswith(QWEN3.opening("mul")) and named["choices"][0]["finish_reason"] == "stop"
    assert named["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "mul", "arguments": '{"a": 2}'}

    # the real model, same opening: what comes back is exactly what it sampled after the prompt
    with BackgroundServer(build_app(engine, model_dir=model_dir, served_model_name="v0", batch_wait_ms=1,
                                    reply_parser="qwen3")) as real:
        got = _chat(real.url, {**body, "max_tokens": 12}).json()
    assert got["prompt_token_ids"] == out["prompt_token_ids"]
    want = engine.generate([got["prompt_token_ids"]], SamplingParams(max_tokens=12, num_top_logprobs=1,
                                                                      stop_token_ids=(EOS,)), seed=3)[0]
    assert got["choices"][0]["token_ids"] == want.output_token_ids
    msg = got["choices"][0]["message"]
    assert msg.get("tool_calls") or msg["content"].startswith(opening)  # a tiny model's call rarely parses


# ----------------------------------------------------------------------------- through the recorder


def test_a_tool_using_conversation_is_one_recorded_trajectory(scripted, tmp_path, engine, model_dir):
    cfg = RecorderConfig(upstream=scripted.url, store_dir=str(tmp_path / "store"), tokenizer_dir=str(model_dir),
                         token=TOKEN)
    app = build_recorder_app(cfg)
    with BackgroundServer(app) as srv:
        client = _client(srv.url, api_key=TOKEN, default_headers={"X-Trajectory-Id": "agent-1"})
        messages = list(USER)
        first = client.chat.completions.create(model="v0", messages=messages, tools=[ADD, MUL], max_tokens=140,
                                               parallel_tool_calls=False)
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1  # of the two sampled
        messages.append(msg.model_dump(exclude_none=True))  # the reasoning echoed back, as pydantic-ai does
        messages += [{"role": "tool", "tool_call_id": t.id, "content": "ok"} for t in msg.tool_calls]
        stream = client.chat.completions.create(model="v0", messages=messages, tools=[ADD, MUL], max_tokens=30,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "\n\n16"
        forced = client.chat.completions.create(model="v0", messages=USER, tools=[ADD, MUL], max_tokens=40,
                                                tool_choice="required")
        assert forced.choices[0].message.tool_calls[0].function.name == "add"
        no_tools = client.chat.completions.create(model="v0", messages=USER, max_tokens=140)  # reasoning parsed
        assert no_tools.choices[0].message.content.startswith("\n\n<tool_call>")
        stats = httpx.get(srv.url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()["counters"]
        assert app.state.recorder.ingestor.flush(30)
        rows = sorted(app.state.recorder.store.read_calls().to_pylist(), key=lambda r: r["call_index"])
    assert stats.get("unrecordable_calls", 0) == 0 and stats["recorded_calls"] == 4
    assert [(r["trajectory_id"], r["call_index"]) for r in rows] == [("agent-1", i) for i in range(4)]
    tok = engine.tokenizer
    for r in rows:  # the sampled text, not the parsed message content
        assert r["output_text"] == tok.decode(r["output_token_ids"][:-1]) and r["output_token_ids"][-1] == EOS
    assert rows[0]["output_text"] == rows[3]["output_text"] == CALLS and rows[1]["output_text"] == ANSWER
    assert "<tool_response>\nok\n</tool_response>" in rows[1]["prompt_text"]
    assert rows[2]["prompt_text"].endswith(QWEN3.opening(None)) and rows[2]["output_text"].startswith('add", ')


def test_reply_parser_settings_and_server_flags(tmp_path):
    from prodrl_pipelines.config.settings import settings_from_flat
    from prodrl_pipelines.deploy_targets.servers import ProdrlServeTarget, VLLMRestartTarget

    assert settings_from_flat({}).deploy.reply_parser == "none"
    for target, flags in ((ProdrlServeTarget, ["--reply-parser", "qwen3"]),
                          (VLLMRestartTarget, list(QWEN3.vllm_args))):
        s = settings_from_flat({"reply_parser": "qwen3", "target": target.name, "vllm_python": "/bin/python3"})
        cmd = target(s, tmp_path).command(tmp_path, 8000, "v1")
        assert any(cmd[i:i + len(flags)] == flags for i in range(len(cmd))), cmd
        plain = target(settings_from_flat({"target": target.name, "vllm_python": "/bin/python3"}), tmp_path)
        assert not {"--reply-parser", "--tool-call-parser"} & set(plain.command(tmp_path, 8000, "v1"))
    assert settings_from_flat({"reply_parser": "qwen3"}).deploy.reply_parser == "qwen3"
    with pytest.raises(ValueError, match="reply_parser: unknown reply parser 'hermes'; valid: none, qwen3"):
        settings_from_flat({"reply_parser": "hermes"})
    assert reply_parser_flags("none", vllm=True) == [] and reply_parser_flags("qwen3", vllm=False) == [
        "--reply-parser", "qwen3"]
    assert reply_parser_flags("qwen3", vllm=True) == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                                      "--reasoning-parser", "qwen3"]
    with pytest.raises(ProtocolError):
        plan_tools({"tools": [ADD]}, None)  # auto (the default with tools) needs a parser
