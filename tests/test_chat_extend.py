"""``chat_history: extend`` (recorder.chat_extend): a session's chat calls are rendered by the recorder
and sent as extensions of the previous call's tokens, so every recorded prompt extends the previous
prompt + output even where the template rewrites history (the Qwen3-style template drops earlier
reasoning: re-rendering breaks the extension there). The scripted tool-calling engine of
test_chat_tools answers; the server, recorder and openai client are real."""

from __future__ import annotations

import httpx
import openai
import pytest

from prodrl_pipelines.engines.server import BackgroundServer, build_app
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.recorder.chat_extend import PLACEHOLDER, echoes
from tests.test_chat_tools import TOKEN, ScriptedEngine, model_dir  # noqa: F401

# short replies: a whole episode fits the tiny model's 256 positions
CALL = '<think>\nx\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
ANSWER = "<think>\ny\n</think>\n\n16"
USER = [{"role": "user", "content": "12+7?"}]
ADD = {"type": "function", "function": {"name": "add", "description": "", "parameters": {"type": "object"}}}


class ShortScript(ScriptedEngine):
    @staticmethod
    def reply(prompt: str) -> str:
        return ANSWER if "<tool_response>" in prompt[prompt.rfind("<|im_start|>user"):] else CALL


@pytest.fixture(scope="module")
def scripted(engine, model_dir):  # noqa: F811
    app = build_app(ShortScript(engine), model_dir=model_dir, served_model_name="v0", batch_wait_ms=1,
                    reply_parser="qwen3")
    with BackgroundServer(app) as srv:
        yield srv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _episode(url: str, session: str, stream: bool = False) -> list:
    """A tool call, its result, the answer; a new user turn, a tool call (3 calls): the replies as the
    client saw them."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60,
                           default_headers={"X-Session-Id": session})
    messages, seen = list(USER), []
    for turn in range(2):
        if turn:
            messages.append({"role": "user", "content": "5+5?"})
        for _ in range(2 - turn):
            kw = dict(model="v0", messages=messages, tools=[ADD], parallel_tool_calls=False)  # the length the model has left
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **kw))
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
                msg = {"role": "assistant", "content": content or None}
                if calls:
                    msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {
                        "name": t.function.name, "arguments": t.function.arguments}} for t in calls]
            else:
                msg = client.chat.completions.create(**kw).choices[0].message.model_dump(
                    exclude_none=True, include={"role", "content", "tool_calls"})
            seen.append(msg)
            messages.append(msg)
            messages += [{"role": "tool", "tool_call_id": t["id"], "content": "9"} for t in msg.get("tool_calls", [])]
    return seen


def _rows(app) -> list[dict]:
    assert app.state.recorder.ingestor.flush(30)
    return sorted(app.state.recorder.store.read_calls().to_pylist(), key=lambda r: (r["trajectory_id"], r["call_index"]))


def _extends(rows: list[dict]) -> list[bool]:
    """For each call after the first: its prompt starts with the previous call's prompt + output."""
    out = []
    for a, b in zip(rows, rows[1:]):
        head = a["prompt_token_ids"] + a["output_token_ids"]
        out.append(b["prompt_token_ids"][: len(head)] == head)
    return out


def _stats(url: str) -> dict:
    return httpx.get(url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()["counters"]


@pytest.mark.parametrize("stream", [False, True])
def test_extend_keeps_every_prompt_an_extension_where_rerendering_breaks_it(scripted, model_dir, tmp_path, stream):
    def run(mode: str):
        cfg = RecorderConfig(upstream=scripted.url, store_dir=str(tmp_path / mode / "store"), token=TOKEN,
                             tokenizer_dir=str(model_dir), chat_history=mode, reply_parser="qwen3")
        app = build_recorder_app(cfg)
        with BackgroundServer(app) as srv:
            seen = _episode(srv.url, "agent-1", stream)
            return seen, _rows(app), _stats(srv.url)

    seen_r, rows_r, _ = run("rerender")
    seen_e, rows_e, stats = run("extend")
    # the client sees the same conversation either way: a call, the answer, a call, the answer
    for seen in (seen_r, seen_e):
        assert [bool(m.get("tool_calls")) for m in seen] == [True, False, True]
        # the newlines after </think> stay content, as vLLM's qwen3 parser leaves them
        assert seen[1]["content"] == "\n\n16" and seen[0]["tool_calls"][0]["function"]["name"] == "add"
    assert len(rows_r) == len(rows_e) == 3 and {r["trajectory_id"] for r in rows_e} == {"agent-1"}
    # re-rendered, the history holds what the client echoed (no reasoning, as the openai client's message
    # model keeps it): neither later call extends the one before
    assert _extends(rows_r) == [False, False]
    assert _extends(rows_e) == [True, True]
    assert [r["output_text"] for r in rows_e] == [CALL, ANSWER, CALL]
    assert stats["extend_bridged"] == 2 and stats["extend_rendered.first_call"] == 1
    assert all(PLACEHOLDER not in r["prompt_text"] for r in rows_e)
    # the bridge is the template's own text: the tool result and the next user turn are in the prompt
    assert "<tool_response>\n9\n</tool_response>" in rows_e[1]["prompt_text"]
    assert rows_e[2]["prompt_text"].rstrip().endswith("5+5?<|im_end|>\n<|im_start|>assistant")


def test_a_retry_a_changed_history_and_calls_without_a_session(scripted, model_dir, tmp_path):
    cfg = RecorderConfig(upstream=scripted.url, store_dir=str(tmp_path / "store"), token=TOKEN,
                         tokenizer_dir=str(model_dir), chat_history="extend", reply_parser="qwen3")
    app = build_recorder_app(cfg)
    auth = {"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "s"}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, headers=auth, timeout=60) as h:
        body = {"model": "v0", "messages": list(USER), "tools": [ADD]}
        first = h.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        follow = {**body, "messages": [*USER, first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                                                        "content": "19"}]}
        a = h.post("/v1/chat/completions", json=follow, headers={"x-stainless-retry-count": "0"})
        b = h.post("/v1/chat/completions", json=follow, headers={"x-stainless-retry-count": "1"})  # the client's retry
        assert a.status_code == b.status_code == 200
        edited = {**follow, "messages": [{"role": "user", "content": "what is 1+1?"}, *follow["messages"][1:]]}
        assert h.post("/v1/chat/completions", json=edited).status_code == 200
        plain = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60,
                           headers={"Authorization": auth["Authorization"]})  # no session: the plain path
        assert plain.status_code == 200
        stats = _stats(srv.url)
        rows = _rows(app)
    assert stats["extend_bridged"] == 2  # the call and its retry, both from the first turn
    assert stats["extend_rendered.first_call"] == 1 and stats["extend_rendered.history_changed"] == 1
    mine = [r for r in rows if r["trajectory_id"] == "s"]
    assert len(mine) == 3  # the retry superseded its first attempt
    assert _extends(mine[:2]) == [True]


def test_an_echo_is_the_reply_it_answers():
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    assert echoes({**call, "tool_calls": [{"id": "y", "function": {"name": "add", "arguments": {"a": 1}}}]}, call)
    assert not echoes({**call, "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}]}, call)
    assert echoes({"role": "assistant", "content": " 16 "}, {"content": "16"})
    assert not echoes({"role": "user", "content": "16"}, {"content": "16"})


def test_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="chat_history must be 'rerender' or 'extend'"):
        RecorderConfig(upstream="http://x", store_dir=str(tmp_path), token="t", chat_history="append")
    with pytest.raises(ValueError, match="reply_parser must be 'none' or one of"):
        RecorderConfig(upstream="http://x", store_dir=str(tmp_path), token="t", reply_parser="hermes2")


def test_a_responses_session_is_extended_too(scripted, model_dir, tmp_path):
    """The Responses API through extend (the openai client, not streamed): translated to chat as on
    the plain path, the call after a function call's output bridged, answered as a Response."""
    cfg = RecorderConfig(upstream=scripted.url, store_dir=str(tmp_path / "store"), token=TOKEN,
                         tokenizer_dir=str(model_dir), chat_history="extend", reply_parser="qwen3")
    app = build_recorder_app(cfg)
    tool = {"type": "function", "name": "add", "description": "", "parameters": {"type": "object"}, "strict": False}
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60,
                               default_headers={"X-Session-Id": "resp-1"})
        items: list = [{"role": "user", "content": USER[0]["content"]}]
        first = client.responses.create(model="v0", input=items, tools=[tool])
        calls = [o for o in first.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "add"
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "9"})
        second = client.responses.create(model="v0", input=items, tools=[tool])
        assert second.output_text == "\n\n16" and second.status == "completed"
        stats = _stats(srv.url)
        rows = _rows(app)
    assert stats["extend_bridged"] == 1 and stats["extend_rendered.first_call"] == 1
    assert [r["output_text"] for r in rows] == [CALL, ANSWER] and _extends(rows) == [True]
    assert second.usage.input_tokens == len(rows[1]["prompt_token_ids"])
