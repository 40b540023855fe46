"""The Responses API through the recorder, with the official openai client: answered like the chat call
it is translated to, streamed and not, recorded with the same fields."""

from __future__ import annotations

import openai
import pytest

from prodrl_pipelines.engines.openai_protocol import ProtocolError
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.lab.episodes import render_prompt
from prodrl_pipelines.recorder.responses import INCLUDABLE, LOGPROBS_INCLUDE, ResponsesShape
from tests.test_recorder import EOS, TOKEN, direct, start_recorder, upstream  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _client(r, tid: str) -> openai.OpenAI:
    client = openai.OpenAI(base_url=r.srv.url + "/v1", api_key=TOKEN, max_retries=0,
                           default_headers={"X-Trajectory-Id": tid})
    client.model = client.models.list().data[0].id  # the upstream's served name
    return client


def test_a_response_is_the_chat_answer_and_recorded_like_a_chat_call(upstream, start_recorder, engine):
    r = start_recorder(upstream.url)
    client = _client(r, "resp-1")
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}]
    resp = client.responses.create(model=client.model, instructions="add", input=[{"role": "user", "content": "3+4="}],
                                   max_output_tokens=6, temperature=1.0, extra_body={"seed": 5})
    chat = client.chat.completions.create(model=client.model, messages=messages, max_tokens=6, temperature=1.0, seed=5)
    # the same seeded sample either way; its text may be empty (a tiny model), so only equality is asserted
    assert resp.object == "response" and resp.output_text == (chat.choices[0].message.content or "")
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.input_tokens == chat.usage.prompt_tokens

    rows = sorted(r.store().read_calls().to_pylist(), key=lambda x: x["call_index"])
    assert [x["call_index"] for x in rows] == [0, 1] and {x["trajectory_id"] for x in rows} == {"resp-1"}
    text, ids = render_prompt(engine.tokenizer, messages)
    want = engine.generate([ids], SamplingParams(max_tokens=6, num_top_logprobs=20, stop_token_ids=(EOS,)), seed=5)[0]
    for row in rows:  # the Responses call and the chat call: one record
        assert row["prompt_token_ids"] == ids and row["prompt_text"] == text
        assert row["output_token_ids"] == want.output_token_ids
        assert row["output_logprobs"] == pytest.approx(want.output_logprobs, abs=1e-6)
        assert len(row["top_token_ids"][0]) == 19
    assert {k: v for k, v in rows[0].items() if k not in ("call_index", "created_at")} == \
        {k: v for k, v in rows[1].items() if k not in ("call_index", "created_at")}
    client.close()


def test_a_streamed_response_and_its_logprobs(upstream, start_recorder, engine):
    r = start_recorder(upstream.url)
    client = _client(r, "resp-s")
    kw = dict(model=client.model, input="6+2=", max_output_tokens=7, include=[LOGPROBS_INCLUDE], top_logprobs=2,
              extra_body={"seed": 9})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    lps = whole.output[0].content[0].logprobs
    ids = render_prompt(engine.tokenizer, [{"role": "user", "content": "6+2="}])[1]
    want = engine.generate([ids], SamplingParams(max_tokens=7, num_top_logprobs=20, stop_token_ids=(EOS,)), seed=9)[0]
    assert len(lps) == len(want.output_token_ids) and all(len(x.top_logprobs) == 2 for x in lps)
    assert [x.logprob for x in lps] == pytest.approx(want.output_logprobs, abs=1e-5)
    streamed_lps = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    assert [x.logprob for x in streamed_lps] == pytest.approx(want.output_logprobs, abs=1e-5)

    rows = sorted(r.store().read_calls().to_pylist(), key=lambda x: x["call_index"])
    assert len(rows) == 2 and rows[0]["output_token_ids"] == rows[1]["output_token_ids"] == want.output_token_ids
    assert r.stats()["recorded_calls"] == 2
    client.close()


def test_what_cannot_be_translated_is_a_400_naming_the_field(upstream, start_recorder):
    r = start_recorder(upstream.url)
    client = _client(r, "resp-bad")
    cases = [
        (dict(input="x", previous_response_id="resp_1"), "`previous_response_id` needs server-side state"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
         "`input[0].content[0]` is a 'input_image' part"),
        (dict(input="x", tools=[{"type": "web_search"}]), "`tools[0]` is a 'web_search' tool"),
        (dict(input="x", include=["message.output_text.bogus"]), "`include` holds 'message.output_text.bogus', "
         "not a value of the Responses API"),
        (dict(input="x", tools=[], tool_choice="required"), "`tool_choice` 'required' forces a tool call"),
        (dict(input=[]), "`input` must be a string or a non-empty list"),
    ]
    for kw, fragment in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=client.model, max_output_tokens=2, **kw)
        assert e.value.status_code == 400 and fragment in str(e.value), str(e.value)
    assert r.stats()["bad_requests"] == len(cases)
    assert r.http.get("/health").status_code == 200
    client.close()


def test_tool_calls_and_their_results_become_chat_messages():
    shape = ResponsesShape({
        "model": "m", "instructions": "be brief", "max_output_tokens": 5, "seed": 3, "top_k": 10,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather in "}, {"type": "input_text", "text": "Oslo?"}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "rain"},
            {"type": "message", "role": "developer", "content": "answer now"},
        ],
        "tools": [{"type": "function", "name": "weather", "description": "w", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "weather"},
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
    })
    assert shape.chat_request() == {
        "model": "m", "seed": 3, "top_k": 10, "max_tokens": 5,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "system", "content": "answer now"},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "description": "w"}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
    }
    answer = shape.answer({"model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]}}]}, None)
    assert answer["status"] == "completed"
    assert answer["output"] == [{"type": "function_call", "id": "fc_c9", "call_id": "c9", "name": "weather",
                                 "arguments": "{}", "status": "completed"}]
    with pytest.raises(ProtocolError, match="`input\\[0\\].role` must be user"):
        ResponsesShape({"input": [{"role": "tool", "content": "x"}]}).chat_request()


def test_the_message_item_before_its_calls_is_one_assistant_turn_with_them():
    """A streamed Response opens a message item before its function calls (empty when the answer is
    calls only); clients send both back: one assistant turn, as the model produced it, not an empty
    turn the model never wrote followed by the calls."""
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
    for said, content in (("", None), ("let me add", "let me add")):
        msgs = ResponsesShape({"model": "m", "input": [
            {"role": "user", "content": "1+1?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": said}]},
            call, {"type": "function_call_output", "call_id": "c1", "output": "2"}]}).chat_request()["messages"]
        assert msgs == [{"role": "user", "content": "1+1?"},
                        {"role": "assistant", "content": content, "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "2"}]


# ----------------------------------------------------------------------------- what agent SDKs send


def test_what_openai_agents_sends_by_default_is_answered_and_recorded(upstream, start_recorder, direct, engine):
    """openai-agents' default Responses request: ``tools: []`` (which ``prodrl serve``, like vLLM 0.32,
    refuses in a chat request), ``include: []``, ``parallel_tool_calls: false``, ``store: false``,
    ``metadata``; and an ``include`` of values that select no translated output. Unseeded, as the SDK
    sends them: what is checked holds for any sample (4 tokens of a tiny model may decode to no text)."""
    refused = direct.post("/v1/chat/completions", json={"model": "v0", "messages": [{"role": "user", "content": "x"}],
                                                         "tools": [], "max_tokens": 2})
    assert refused.status_code == 400 and "must not be an empty array" in refused.text
    r = start_recorder(upstream.url)
    client = _client(r, "agents-1")
    kinds, answers = [], []
    for extra in (dict(include=[], tools=[], parallel_tool_calls=False, store=False, metadata={"run": "1"}),
                  dict(include=["reasoning.encrypted_content", LOGPROBS_INCLUDE], tools=[], tool_choice="auto",
                       store=False, top_logprobs=1),
                  dict(tools=[], tool_choice="none", stream=True, store=True)):
        out = client.responses.create(model=client.model, input="3+4=", max_output_tokens=4, **extra)
        if extra.get("stream"):
            out = [e for e in out][-1].response
        assert out.object == "response" and out.store is False, out
        assert out.status in ("completed", "incomplete"), out
        kinds.append(out.parallel_tool_calls)
        answers.append(out)
    assert kinds == [False, True, True]
    rows = sorted(r.store().read_calls().to_pylist(), key=lambda x: x["call_index"])
    assert [x["call_index"] for x in rows] == [0, 1, 2] and {x["trajectory_id"] for x in rows} == {"agents-1"}
    for out, row in zip(answers, rows):  # each answer is the sample recorded for it
        assert out.usage.output_tokens == len(row["output_token_ids"]) and 1 <= len(row["output_token_ids"]) <= 4
        assert out.output_text == engine.tokenizer.decode(row["output_token_ids"], skip_special_tokens=True)
    assert r.stats().get("bad_requests", 0) == 0
    client.close()


def test_tools_keep_their_strict_flag_and_parallel_tool_calls_is_forwarded():
    tools = [{"type": "function", "name": "add", "description": "a+b", "strict": True,
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                             "additionalProperties": False}},
             {"type": "function", "name": "loose", "strict": False, "parameters": None},
             {"type": "function", "name": "plain"}]
    for parallel in (False, True):
        chat = ResponsesShape({"input": "x", "tools": tools, "parallel_tool_calls": parallel}).chat_request()
        assert chat["parallel_tool_calls"] is parallel
        assert chat["tools"] == [
            {"type": "function", "function": {"name": "add", "parameters": tools[0]["parameters"], "description": "a+b",
                                              "strict": True}},
            {"type": "function", "function": {"name": "loose", "parameters": {"type": "object", "properties": {}},
                                              "strict": False}},
            {"type": "function", "function": {"name": "plain", "parameters": {"type": "object", "properties": {}}}}]
    assert "parallel_tool_calls" not in ResponsesShape({"input": "x", "tools": tools}).chat_request()
    assert ResponsesShape({"input": "x", "tools": tools, "tool_choice": "required"}).chat_request()["tool_choice"] == "required"


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_an_empty_tools_list_is_left_out_with_the_choices_that_mean_no_call(tool_choice):
    body = {"input": "x", "tools": [], "store": False, "include": [], "metadata": {"k": "v"}, "parallel_tool_calls": False}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    chat = ResponsesShape(body).chat_request()
    assert chat == {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": False}
    assert ResponsesShape({"input": "x", "tool_choice": "auto"}).chat_request() == {
        "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ProtocolError, match="forces a tool call, but `tools` holds no function tool"):
        ResponsesShape({"input": "x", "tools": [], "tool_choice": {"type": "function", "name": "f"}}).chat_request()


def test_every_include_value_of_the_api_is_accepted_and_previous_response_id_is_refused():
    shape = ResponsesShape({"input": "x", "include": sorted(INCLUDABLE), "store": False})
    assert shape.logprobs and shape.chat_request()["logprobs"] is True
    assert not ResponsesShape({"input": "x", "include": ["reasoning.encrypted_content"]}).logprobs
    for bad, why in ((["x"], "not a value of the Responses API"), ("reasoning.encrypted_content", "must be a list"),
                     ([1], "must be a list of strings")):
        with pytest.raises(ProtocolError, match=why):
            ResponsesShape({"input": "x", "include": bad})
    with pytest.raises(ProtocolError, match="`previous_response_id` needs server-side state, which the recorder keeps "
                       "none of: send the whole conversation as `input`"):
        ResponsesShape({"input": "x", "previous_response_id": "resp_1", "store": False})


def test_reasoning_settings_reach_the_server_as_chat_reasoning_effort():
    """inspect's Responses mode sends ``reasoning: {"summary": "auto"}``; an agent may send an effort."""
    assert "reasoning_effort" not in ResponsesShape({"input": "x", "reasoning": {"summary": "auto"}}).chat_request()
    chat = ResponsesShape({"input": "x", "reasoning": {"effort": "low", "summary": None}}).chat_request()
    assert chat["reasoning_effort"] == "low" and "reasoning" not in chat
    for bad in ("high", {"effort": 3}):
        with pytest.raises(ProtocolError, match="`reasoning` must be an object with an optional string `effort`"):
            ResponsesShape({"input": "x", "reasoning": bad})
