"""Real agent SDKs, unpatched, through the recorder: openai-agents (chat completions, and its default
Responses mode streamed), pydantic-ai, a LangGraph ReAct agent over langchain-openai, the official
anthropic client's tool-use loop on the Messages API (streamed and not) and pydantic-ai's
AnthropicModel over it each run a two-question episode with one Python ``add`` tool against the
lab's tool-calling policy
(``tools_policy_dir``) served by ``prodrl serve --reply-parser qwen3``'s app, the episode grouped by
a constant ``X-Trajectory-Id`` in the SDK client's default headers. One server and two recorders in
front of it (``chat_history`` rerender, the default, and extend) serve the whole module.

For each SDK: the episode is one trajectory holding every model call in order; the tool calls parsed
from the recorded ``output_text`` are the calls the SDK executed; every later prompt holds one tool
result per earlier call; no call was skipped as unrecordable. How consecutive calls join into
training sequences (``rl.sequences.split_reason``) is checked against the table of docs/agents.md
(``JOINS``): that table is what these episodes measured.

The episodes are ``lab.sdk_agents``' (one function per SDK, also driven by bench/agent_traffic.py);
what each SDK sends is seen through an httpx event hook on its client (ordinary client
configuration: nothing in the SDK is patched).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.reply_parsers import parse_qwen3
from prodrl_pipelines.engines.server import BackgroundServer, build_app
from prodrl_pipelines.lab.sdk_agents import QUESTIONS, SDKS, Episode
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.rl.sequences import split_reason

TOKEN = "agents-token"
MODEL = "tools-policy"
M, OR, HE = "merged", "output_rewritten", "history_edited"
# how call k+1 joins call k in each SDK's episode (call 0: the first add call; 1: the answer after its
# result; 2: the second question's call; 3: its answer), with the recorder re-rendering (the default)
# or extending; docs/agents.md explains each split
# (1 -> 2 without echoed reasoning: the answer's content keeps the newlines after </think>, which merge with the
# newline that opens its turn in the next prompt)
JOINS = {
    ("openai-agents-chat", "rerender"): [OR, HE, OR],  # reasoning not echoed: the call is re-rendered without it
    ("openai-agents-chat-replay", "rerender"): [M, HE, M],  # echoed; the next question drops it (the template)
    ("openai-agents-responses", "rerender"): [OR, HE, OR],  # no reasoning item comes back to echo
    ("pydantic-ai", "rerender"): [M, HE, M],
    ("langgraph", "rerender"): [OR, HE, OR],
    ("openai-agents-chat", "extend"): [M, M, M],
    ("openai-agents-chat-replay", "extend"): [M, M, M],
    ("openai-agents-responses", "extend"): [M, M, M],
    ("pydantic-ai", "extend"): [M, M, M],
    ("langgraph", "extend"): [M, M, M],
    # the Messages API: thinking blocks are echoed (signed by the recorder, as the clients require)
    ("anthropic", "rerender"): [M, HE, M],
    ("anthropic-stream", "rerender"): [M, HE, M],
    ("pydantic-ai-anthropic", "rerender"): [M, HE, M],
    ("anthropic", "extend"): [M, M, M],
    ("anthropic-stream", "extend"): [M, M, M],
    ("pydantic-ai-anthropic", "extend"): [M, M, M],
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def recorders(tools_policy_dir, tmp_path_factory):
    """``chat_history`` -> a recorder (its URL and service) in front of one server on the tools policy."""
    engine = LocalEngine.from_pretrained(tools_policy_dir)
    served = build_app(engine, model_dir=tools_policy_dir, served_model_name=MODEL, batch_wait_ms=1,
                       reply_parser="qwen3")
    root = tmp_path_factory.mktemp("agents")
    with BackgroundServer(served) as upstream:
        out, servers = {}, []
        try:
            for history in ("rerender", "extend"):
                cfg = RecorderConfig(upstream=upstream.url, store_dir=str(root / history), token=TOKEN,
                                     tokenizer_dir=str(tools_policy_dir), chat_history=history, reply_parser="qwen3")
                app = build_recorder_app(cfg)
                servers.append(BackgroundServer(app).start())
                out[history] = SimpleNamespace(url=servers[-1].url, base_url=servers[-1].url + "/v1",
                                               rec=app.state.recorder)
            yield out
        finally:
            for srv in servers:
                srv.stop()


def _rows(recorder, tid: str) -> list[dict]:
    assert recorder.rec.ingestor.flush(30)
    rows = [r for r in recorder.rec.store.read_calls().to_pylist() if r["trajectory_id"] == tid]
    return sorted(rows, key=lambda r: r["call_index"])


def _joins(rows: list[dict]) -> list[str]:
    """How each call after the first joins the one before: ``merged`` or the split reason."""
    calls = [SimpleNamespace(prompt_ids=r["prompt_token_ids"], output_ids=r["output_token_ids"]) for r in rows]
    return [split_reason(a, b) or M for a, b in zip(calls, calls[1:])]


def check_episode(recorder, ep: Episode) -> list[str] | None:
    """The checks every SDK's episode must pass; returns how its calls join (``_joins``)."""
    rows = _rows(recorder, ep.tid)
    assert ep.n_calls == len(ep.sent) and [r["call_index"] for r in rows] == list(range(ep.n_calls)), \
        "one trajectory, every call, in order"
    parsed = [[{"name": c["function"]["name"], **json.loads(c["function"]["arguments"])}
               for c in parse_qwen3(r["output_text"]).get("tool_calls") or []] for r in rows]
    # the recorded replies hold exactly the calls the SDK executed
    assert [c for calls in parsed for c in calls] == [{"name": "add", **c} for c in ep.executed]
    results = [str(c["a"] + c["b"]) for c in ep.executed]
    for k, r in enumerate(rows):  # every later prompt holds one tool result per earlier call
        earlier = sum(len(p) for p in parsed[:k])
        assert r["prompt_text"].count("<tool_response>") == earlier, (k, r["prompt_text"])
        assert all(f"<tool_response>\n{res}\n</tool_response>" in r["prompt_text"] for res in results[:earlier])
    stats = httpx.get(recorder.url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    assert stats["counters"].get("unrecordable_calls", 0) == 0, stats["counters"]
    # the tiny policy's script (a call on each question, then the answer in text) is a sample: it holds
    # with AVX512 kernels and not always with AVX2's, so the joins it implies are checked only when it held
    scripted = ([len(p) for p in parsed] == [1, 0] * len(QUESTIONS) and len(ep.answers) == len(QUESTIONS)
                and all(a and "<tool_call>" not in a for a in ep.answers))
    return _joins(rows) if scripted else None


@pytest.mark.parametrize("history", ["rerender", "extend"])
@pytest.mark.parametrize("sdk", list(SDKS))
def test_an_sdk_episode_is_one_recorded_trajectory(recorders, sdk, history):
    recorder = recorders[history]
    ep = SDKS[sdk](recorder.base_url, f"{sdk}-{history}", api_key=TOKEN, model=MODEL)
    joins = check_episode(recorder, ep)
    print(f"\n{sdk} {history}: {ep.n_calls} calls, joins {joins}; sent "
          f"{[(path, body.get('stream', False)) for path, body in ep.sent]}")
    assert joins is None or joins == JOINS[(sdk, history)]  # None: the policy left its script (printed above)
    paths = {path for path, _ in ep.sent}
    streamed = {body.get("stream", False) for _, body in ep.sent}
    if sdk == "openai-agents-responses":  # the SDK's default mode, streamed
        assert paths == {"/responses"} and streamed == {True}
    elif "anthropic" in sdk:  # the Messages API
        assert paths == {"/messages"} and streamed == {sdk == "anthropic-stream"}
    else:
        assert paths == {"/chat/completions"} and streamed == {sdk == "langgraph"}
