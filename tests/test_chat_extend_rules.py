"""``chat_history: extend`` keeps the plain path's promises: a call the plain path would not record as
trainable (greedy, a penalty, a constraint, a structured output) or that asks for a rendering of its own
(``reasoning_effort``, ``chat_template``, ...) takes the plain path with a counted reason, so the
upstream honours what was asked and the record says what it is; a template's own switches
(``chat_template_kwargs``, Qwen3's ``enable_thinking``) are rendered with, in the prompt and in every
bridge; a call whose client disconnected
is not committed; a reply that left sampled tool calls out (``parallel_tool_calls: false``) is not
extended by the next call. The scripted tool-calling engine of test_chat_tools answers; the server,
recorder and openai client are real."""

from __future__ import annotations

import shutil
import time

import httpx
import openai
import pytest

from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.recorder.chat_extend import extend_refusal
from tests.test_chat_tools import ADD, TEMPLATE, TOKEN, scripted  # noqa: F401 - scripted: on this module's model_dir
from tests.test_recorder import FakeUpstream, serving

USER = [{"role": "user", "content": "12+7?"}]
GENERATION = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
# Qwen3's switch in the lab's markup: with enable_thinking false the generation prompt holds an empty
# reasoning block
NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
THINKING_TEMPLATE = TEMPLATE.replace(GENERATION, (
    "{%- if add_generation_prompt -%}{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}{%- endif -%}"), 1)
MUL = {"type": "function", "function": {"name": "mul", "description": "", "parameters": {"type": "object"}}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_policy_dir, tmp_path_factory):
    assert THINKING_TEMPLATE != TEMPLATE
    out = tmp_path_factory.mktemp("thinking") / "policy"
    shutil.copytree(tiny_policy_dir, out)
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return out


@pytest.fixture
def recorder(scripted, model_dir, tmp_path):
    cfg = RecorderConfig(upstream=scripted.url, store_dir=str(tmp_path / "store"), token=TOKEN,
                         tokenizer_dir=str(model_dir), chat_history="extend", reply_parser="qwen3")
    app = build_recorder_app(cfg)
    with BackgroundServer(app) as srv:
        yield srv, app


def _stats(url: str) -> dict:
    return httpx.get(url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60).json()["counters"]


def _rows(app) -> list[dict]:
    assert app.state.recorder.ingestor.flush(60)
    return sorted(app.state.recorder.store.read_calls().to_pylist(), key=lambda r: r["call_index"])


@pytest.mark.parametrize("fields, why", [
    ({"temperature": 0}, "unrecordable"),
    ({"temperature": 0.0}, "unrecordable"),
    ({"presence_penalty": 0.5}, "unrecordable"),
    ({"frequency_penalty": -0.2}, "unrecordable"),
    ({"repetition_penalty": 1.1}, "unrecordable"),
    ({"min_p": 0.05}, "unrecordable"),
    ({"logit_bias": {"5": 10}}, "unrecordable"),
    ({"response_format": {"type": "json_object"}}, "unrecordable"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "unrecordable"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "unrecordable"),
    ({"guided_json": {"type": "object"}}, "unrecordable"),
    ({"n": 2}, "n"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, None),  # rendered with (the template's switch)
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    # neutral values change nothing: the extend path takes them
    ({"temperature": 1.0, "top_p": 0.9, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}, None),
    ({"response_format": {"type": "text"}, "add_generation_prompt": True, "continue_final_message": False,
      "chat_template_kwargs": {}, "reasoning_effort": None}, None),
])
def test_what_the_extend_path_refuses_and_why(fields, why):
    assert extend_refusal({"model": "v0", "messages": USER, **fields}) == why


def test_a_greedy_call_in_a_session_is_the_plain_paths_unrecordable_call(recorder):
    srv, app = recorder
    h = {"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "g"}
    with httpx.Client(base_url=srv.url, headers=h, timeout=60) as c:
        greedy = c.post("/v1/chat/completions", json={"model": "v0", "messages": USER, "temperature": 0})
        sampled = c.post("/v1/chat/completions", json={"model": "v0", "messages": USER, "temperature": 1.0})
    assert greedy.status_code == sampled.status_code == 200, greedy.text
    # answered, its index taken (the trajectory really had that call), never recorded as trainable
    assert greedy.headers["x-prodrl-recorded"] == "false" and greedy.headers["x-call-index"] == "0"
    assert sampled.headers["x-prodrl-recorded"] == "true" and sampled.headers["x-call-index"] == "1"
    s = _stats(srv.url)
    assert s["extend_skipped.unrecordable"] == 1 and s["unrecordable.greedy"] == 1
    rows = _rows(app)
    assert [r["call_index"] for r in rows] == [1] and rows[0]["temperature"] == 1.0


def test_chat_template_kwargs_reach_the_rendering_that_is_recorded(recorder):
    """Qwen3's ``enable_thinking: false``: the extend path renders the call with it, and the recorded
    prompt is that rendering; a call of the session without it is rendered again, not bridged onto a
    prefix rendered otherwise."""
    srv, app = recorder
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60,
                           default_headers={"X-Session-Id": "k"})
    client.chat.completions.create(model="v0", messages=USER, extra_body={
        "chat_template_kwargs": {"enable_thinking": False, "not_read_by_the_template": 1}})
    client.chat.completions.create(model="v0", messages=USER)
    rows = _rows(app)
    assert [r["prompt_text"].endswith(NO_THINK) for r in rows] == [True, False], [r["prompt_text"][-60:] for r in rows]
    s = _stats(srv.url)
    assert s.get("extend_skipped.chat_template_kwargs", 0) == 0
    assert s["extend_rendered.first_call"] == 1 and s["extend_rendered.template_kwargs_changed"] == 1


def test_a_session_without_thinking_is_bridged_with_the_same_kwargs(recorder):
    """Every call of an agent that switched thinking off: the second prompt is the first prompt, the
    sampled output and the bridge, which ends in the generation prompt rendered with the switch; the
    reply is parsed as vLLM parses it when thinking is off (no reasoning)."""
    srv, app = recorder
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60,
                           default_headers={"X-Session-Id": "b"})
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    messages = list(USER)
    msg = client.chat.completions.create(model="v0", messages=messages, extra_body=off).choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    messages += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": "and 3+4?"}]
    client.chat.completions.create(model="v0", messages=messages, extra_body=off)
    first, second = _rows(app)
    assert second["prompt_token_ids"][:len(first["prompt_token_ids"]) + len(first["output_token_ids"])] == \
        first["prompt_token_ids"] + first["output_token_ids"]
    assert first["prompt_text"].endswith(NO_THINK) and second["prompt_text"].endswith(NO_THINK)
    s = _stats(srv.url)
    assert s["extend_bridged"] == 1 and s["extend_rendered.first_call"] == 1


def test_a_reply_that_left_calls_out_is_not_extended(recorder):
    """The model samples two calls; with ``parallel_tool_calls: false`` the client gets the first.
    The next prompt holds what the client ran (one call), not the sampled ids holding both."""
    srv, app = recorder
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60,
                           default_headers={"X-Session-Id": "p"})
    messages = list(USER)
    msg = client.chat.completions.create(model="v0", messages=messages, tools=[ADD, MUL],
                                         parallel_tool_calls=False).choices[0].message
    assert [t.function.name for t in msg.tool_calls] == ["add"]
    messages += [msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                 {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "19"}]
    client.chat.completions.create(model="v0", messages=messages, tools=[ADD, MUL], parallel_tool_calls=False)
    first, second = _rows(app)
    assert '"mul"' in first["output_text"]  # sampled, never run
    assert '"mul"' not in second["prompt_text"] and "<tool_response>\n19\n</tool_response>" in second["prompt_text"]
    s = _stats(srv.url)
    assert s["extend_rendered.reply_truncated"] == 1 and s.get("extend_bridged", 0) == 0
    # with every call kept the next call extends the sampled ids, as before
    messages = list(USER)
    client = client.with_options(default_headers={"X-Session-Id": "q"})
    msg = client.chat.completions.create(model="v0", messages=messages, tools=[ADD, MUL]).choices[0].message
    assert [t.function.name for t in msg.tool_calls] == ["add", "mul"]
    messages += [msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                 *({"role": "tool", "tool_call_id": t.id, "content": "1"} for t in msg.tool_calls)]
    client.chat.completions.create(model="v0", messages=messages, tools=[ADD, MUL])
    assert _stats(srv.url)["extend_bridged"] == 1


@pytest.fixture
def fake():
    yield from serving(FakeUpstream())


def test_a_session_call_whose_client_gave_up_is_not_committed(fake, model_dir, tmp_path):
    """As on the plain path: an attempt whose client disconnected before the answer leaves no row and
    takes no index; the client's retry is call 0."""
    cfg = RecorderConfig(upstream=fake.url, store_dir=str(tmp_path / "store"), token=TOKEN,
                         tokenizer_dir=str(model_dir), chat_history="extend")
    app = build_recorder_app(cfg)
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, timeout=3, max_retries=0,
                               default_headers={"X-Session-Id": "d"})
        fake.delay = 300.0  # held upstream until the client has given up
        try:
            with pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(model="m", messages=USER, max_tokens=3)
        finally:
            fake.delay = 0.0  # the abandoned attempt is answered now
        deadline = time.monotonic() + 120
        while _stats(srv.url).get("client_disconnected", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        s = _stats(srv.url)
        assert s["client_disconnected"] == 1 and s["extend_rendered.first_call"] == 1
        ok = client.with_options(timeout=60).chat.completions.with_raw_response.create(
            model="m", messages=USER, max_tokens=3)
        assert ok.headers["x-call-index"] == "0"
        assert [r["call_index"] for r in _rows(app)] == [0]
