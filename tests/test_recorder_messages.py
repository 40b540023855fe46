"""The Anthropic Messages API through the recorder, with the official ``anthropic`` client (its
``x-api-key`` header is the tenant's token): answered like the chat call it is translated to, streamed
and not, tool use and tool results in both directions, recorded with the same fields as a chat call.
The real tiny model answers the plain calls; the scripted tool-calling engine of test_chat_tools (a
real server with the qwen3 reply parser) answers the tool-using conversation."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from prodrl_pipelines.engines.openai_protocol import ProtocolError
from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.lab.episodes import render_prompt
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.recorder.messages import MessagesShape
from tests.test_chat_tools import ADD, MUL, TOKEN as TOOLS_TOKEN, model_dir, scripted  # noqa: F401 - fixtures
from tests.test_recorder import EOS, TOKEN, start_recorder, upstream  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ADD_TOOL = {"name": "add", "description": "add a number", "input_schema": ADD["function"]["parameters"]}
MUL_TOOL = {"name": "mul", "input_schema": MUL["function"]["parameters"]}


def _client(url: str, token: str, tid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=token, max_retries=0, timeout=60,
                               default_headers={"X-Trajectory-Id": tid})


def _served(url: str, token: str) -> str:
    return httpx.get(url + "/v1/models", headers={"x-api-key": token}, timeout=60).json()["data"][0]["id"]


def test_a_message_is_the_chat_answer_and_recorded_like_a_chat_call(upstream, start_recorder, engine):
    r = start_recorder(upstream.url)
    model = _served(r.srv.url, TOKEN)
    client = _client(r.srv.url, TOKEN, "msg-1")
    msg = client.messages.create(model=model, system="add", messages=[{"role": "user", "content": "3+4="}],
                                 max_tokens=6, extra_body={"temperature": 1.0, "seed": 5})
    chat = openai.OpenAI(base_url=r.srv.url + "/v1", api_key=TOKEN, max_retries=0,
                         default_headers={"X-Trajectory-Id": "msg-1"}).chat.completions.create(
        model=model, messages=[{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}],
        max_tokens=6, temperature=1.0, seed=5)
    # the same seeded sample either way; its text may be empty (a tiny model): equality is asserted
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert msg.type == "message" and msg.role == "assistant" and text == (chat.choices[0].message.content or "")
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)

    rows = sorted(r.store().read_calls().to_pylist(), key=lambda x: x["call_index"])
    assert [x["call_index"] for x in rows] == [0, 1] and {x["trajectory_id"] for x in rows} == {"msg-1"}
    prompt, ids = render_prompt(engine.tokenizer, [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="}])
    want = engine.generate([ids], SamplingParams(max_tokens=6, num_top_logprobs=20, stop_token_ids=(EOS,)), seed=5)[0]
    for row in rows:  # the Messages call and the chat call: one record
        assert row["prompt_token_ids"] == ids and row["prompt_text"] == prompt
        assert row["output_token_ids"] == want.output_token_ids
        assert row["output_logprobs"] == pytest.approx(want.output_logprobs, abs=1e-6)
    assert {k: v for k, v in rows[0].items() if k not in ("call_index", "created_at")} == \
        {k: v for k, v in rows[1].items() if k not in ("call_index", "created_at")}
    client.close()


def test_a_streamed_message_is_the_whole_one(upstream, start_recorder):
    r = start_recorder(upstream.url)
    model = _served(r.srv.url, TOKEN)
    client = _client(r.srv.url, TOKEN, "msg-s")
    kw = dict(model=model, messages=[{"role": "user", "content": "6+2="}], max_tokens=7, extra_body={"seed": 9})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    rows = sorted(r.store().read_calls().to_pylist(), key=lambda x: x["call_index"])
    assert len(rows) == 2 and rows[0]["output_token_ids"] == rows[1]["output_token_ids"]
    assert r.stats()["recorded_calls"] == 2
    client.close()


def test_an_anthropic_key_header_is_a_tenant_token(upstream, start_recorder):
    r = start_recorder(upstream.url)
    body = {"model": _served(r.srv.url, TOKEN), "max_tokens": 2, "messages": [{"role": "user", "content": "1"}]}
    assert httpx.post(r.srv.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=60).status_code == 401
    assert httpx.post(r.srv.url + "/v1/messages", json=body, timeout=60).status_code == 401
    # a bearer header decides when there is one (a wrong bearer is not rescued by a right key)
    assert httpx.post(r.srv.url + "/v1/messages", json=body, timeout=60,
                      headers={"Authorization": "Bearer wrong", "x-api-key": TOKEN}).status_code == 401
    assert httpx.post(r.srv.url + "/v1/messages", json=body, headers={"x-api-key": TOKEN}, timeout=60).status_code == 200


def test_count_tokens_is_the_input_the_message_is_sent_as(upstream, start_recorder):
    """``messages.count_tokens`` (Claude Code's first call) counts what the call's ``usage`` then says
    it sent, under a session's base URL too; nothing is forwarded or recorded."""
    r = start_recorder(upstream.url)
    model = _served(r.srv.url, TOKEN)
    kw = dict(model=model, system="add", messages=[{"role": "user", "content": "3+4="}])
    for base in (r.srv.url, r.srv.url + "/s/sess-1"):
        client = _client(base, TOKEN, "count-1")
        counted = client.messages.count_tokens(**kw).input_tokens
        sent = client.messages.create(**kw, max_tokens=2, extra_body={"seed": 1}).usage.input_tokens
        assert counted == sent > 0
        client.close()
    assert len(r.store().read_calls()) == 2  # the two messages, not the counts
    bad = httpx.post(r.srv.url + "/v1/messages/count_tokens", headers={"x-api-key": TOKEN}, timeout=60,
                     json={"model": model, "messages": []})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"], bad.text
    bad = httpx.post(r.srv.url + "/v1/messages/count_tokens", headers={"x-api-key": TOKEN}, timeout=60,
                     json={**kw, "chat_template_kwargs": "enable_thinking"})
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.json()["error"]["message"], bad.text
    assert httpx.post(r.srv.url + "/v1/messages/count_tokens", json=kw, timeout=60).status_code == 401


@pytest.fixture
def tools_recorder(scripted, model_dir, tmp_path):
    app = build_recorder_app(RecorderConfig(upstream=scripted.url, store_dir=str(tmp_path / "store"), token=TOOLS_TOKEN,
                                            tokenizer_dir=str(model_dir), reply_parser="qwen3"))
    with BackgroundServer(app) as srv:
        yield srv, app


def test_tool_use_and_tool_results_round_trip_streamed_and_not(tools_recorder):
    """The scripted policy thinks, then calls add and mul; the client answers both; the policy thinks
    again. Thinking comes back as a thinking block, the calls as tool_use blocks with their
    input objects (stop_reason tool_use), the same streamed; the tool results go back as chat tool
    messages, and both calls are recorded in one trajectory."""
    srv, app = tools_recorder
    client = _client(srv.url, TOOLS_TOKEN, "agent-1")
    kw = dict(model="v0", max_tokens=150, tools=[ADD_TOOL, MUL_TOOL], messages=[{"role": "user", "content": "12+7"}])
    first = client.messages.create(**kw)
    assert [b.type for b in first.content] == ["thinking", "tool_use", "tool_use"] and first.stop_reason == "tool_use"
    assert first.content[0].thinking.strip() == "12+7"
    assert [(b.name, b.input) for b in first.content[1:]] == [("add", {"a": 19}), ("mul", {"a": 2})]
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    # the same blocks (a call's id is the server's, new for each answer)
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [b.model_dump(exclude={"id"}) for b in first.content]
    assert streamed.stop_reason == "tool_use" and all(b.id for b in streamed.content[1:])

    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "19" if b.name == "add" else [
        {"type": "text", "text": "2"}]} for b in first.content[1:]]
    second = client.messages.create(**{**kw, "max_tokens": 10, "messages": [*kw["messages"],
                                                          {"role": "assistant", "content": first.content},
                                                          {"role": "user", "content": results}]})
    # the tiny model's 256 positions leave the answer 10 tokens: it is cut in its thinking
    assert [b.type for b in second.content] == ["thinking"] and "\n19-3".startswith(second.content[0].thinking)
    assert second.stop_reason == "max_tokens"
    assert app.state.recorder.ingestor.flush(60)
    rows = sorted(app.state.recorder.store.read_calls().to_pylist(), key=lambda x: x["call_index"])
    assert [r["call_index"] for r in rows] == [0, 1, 2] and {r["trajectory_id"] for r in rows} == {"agent-1"}
    assert "<tool_response>" in rows[2]["prompt_text"] and "<tool_response>" not in rows[0]["prompt_text"]
    # the tools and the tool results are counted as the upstream rendered them
    assert client.messages.count_tokens(model="v0", tools=kw["tools"], messages=kw["messages"]).input_tokens \
        == first.usage.input_tokens == len(rows[0]["prompt_token_ids"])
    client.close()


# ------------------------------------------------------------------------ the translation itself

def test_messages_become_chat_messages():
    shape = MessagesShape({"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "be brief",
                                                                       "cache_control": {"type": "ephemeral"}}],
                           "stop_sequences": ["\n\n"], "top_k": 5, "metadata": {"user_id": "u"}, "speed": "fast",
                           "tools": [ADD_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                           "messages": [
                               {"role": "user", "content": "12+7"},
                               {"role": "assistant", "content": [
                                   {"type": "thinking", "thinking": "add", "signature": "s"},
                                   {"type": "redacted_thinking", "data": "x"},
                                   {"type": "text", "text": "calling"},
                                   {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 19}}]},
                               {"role": "user", "content": [
                                   {"type": "tool_result", "tool_use_id": "t1", "content": "19"},
                                   {"type": "text", "text": "and now?"}]}]})
    chat = shape.chat_request()
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "12+7"},
        {"role": "assistant", "content": "calling", "reasoning_content": "add", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 19}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "19"},
        {"role": "user", "content": "and now?"}]
    assert chat["stop"] == ["\n\n"] and chat["max_tokens"] == 9 and chat["top_k"] == 5
    assert "metadata" not in chat and "speed" not in chat
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "description": "add a number",
                                                              "parameters": ADD["function"]["parameters"]}}]
    named = MessagesShape({"max_tokens": 1, "tools": [ADD_TOOL], "tool_choice": {"type": "tool", "name": "add"},
                           "messages": [{"role": "user", "content": "x"}]}).chat_request()
    assert named["tool_choice"] == {"type": "function", "function": {"name": "add"}} and "parallel_tool_calls" not in named
    # a matched stop sequence is named; an EOS is the end of the turn
    answer = {"model": "m", "choices": [{"message": {"content": "7"}, "finish_reason": "stop", "stop_reason": "\n\n"}]}
    out = shape.answer(answer, shape.usage([1, 2], [3], None))
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "\n\n")
    assert out["usage"]["input_tokens"] == 2 and out["usage"]["output_tokens"] == 1
    answer["choices"][0]["stop_reason"] = 2
    assert shape.answer(answer, None)["stop_reason"] == "end_turn"


@pytest.mark.parametrize("fields, needle", [
    ({"max_tokens": None}, "`max_tokens` is required"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "`thinking` can only be disabled"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "`mcp_servers` is not supported"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "`output_config` is not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "`tools[0]` is a 'web_search_20250305' tool"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "`messages[0].content[0]` is a 'image' block"),
    ({"messages": [{"role": "system", "content": "x"}]}, "`messages[0].role` must be user or assistant"),
    ({"tool_choice": {"type": "any"}}, "`tool_choice` 'any' forces a tool call"),
    ({"stop_sequences": "\n"}, "`stop_sequences` must be a list of strings"),
])
def test_what_cannot_be_translated_is_a_400_naming_the_field(fields, needle):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(ProtocolError) as e:
        MessagesShape(body).chat_request()
    assert needle in str(e.value) and e.value.status == 400


def test_the_stream_of_text_then_calls_is_what_the_official_client_accumulates():
    """A chat stream (reasoning, text, two calls whose arguments arrive in pieces) as Messages events:
    each a block of its own, in order, that the anthropic client's own accumulator turns into the
    Message the whole answer gives."""
    shape = MessagesShape({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "x"}]})
    chunks = [{"choices": [{"delta": {"reasoning_content": "think"}}]},
              {"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "add", "arguments": ""}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "c1", "function": {"name": "mul", "arguments": "{}"}}]}}]}]
    raw = b"".join([*shape.start_events(), *(e for c in chunks for e in shape.chunk_events(c)),
                    *shape.end_events("tool_calls", {"input_tokens": 3, "output_tokens": 9})])
    events = [TypeAdapter(RawMessageStreamEvent).validate_json(block.split(b"data: ", 1)[1])
              for block in raw.split(b"\n\n") if block and b"event: ping" not in block]
    message, bufs = None, {}
    for ev in events:
        message = accumulate_event(event=ev, current_snapshot=message, json_bufs=bufs)
    whole = MessagesShape({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "x"}]}).answer(
        {"model": "m", "choices": [{"finish_reason": "tool_calls", "message": {
            "reasoning_content": "think", "content": "ab", "tool_calls": [
                {"id": "c0", "function": {"name": "add", "arguments": '{"a": 1}'}},
                {"id": "c1", "function": {"name": "mul", "arguments": "{}"}}]}}]},
        {"input_tokens": 3, "output_tokens": 9})
    assert [b.model_dump(exclude_none=True) for b in message.content] == whole["content"]
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1, 2, 3]
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 9
