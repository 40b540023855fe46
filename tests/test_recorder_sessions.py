"""Session keys: one agent run is one trajectory without patching its SDK. The trajectory id comes from
``X-Trajectory-Id``, else ``X-Session-Id``, else the session of a ``/s/<session>/v1/...`` base URL
(``calls.SESSION_SOURCES``); a malformed value is a 400 naming its source; ``/stats`` counts the
source of every call. Against the fuzz module's fast upstream (chat, streams, models; no model)."""

from __future__ import annotations

import httpx
import openai
import pytest

from prodrl_pipelines.recorder.calls import SESSION_SOURCES
from tests.test_recorder import AUTH, TOKEN, serving, start_recorder  # noqa: F401 - fixtures
from tests.test_recorder_fuzz import FuzzUpstream

CHAT = {"messages": [{"role": "user", "content": "4+4="}], "max_tokens": 3}
ROUTES = {"/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 3}, "/v1/chat/completions": CHAT,
          "/v1/responses": {"input": "4+4=", "max_output_tokens": 3}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """No model in this module (``tokenizer_dir=None``)."""
    return tmp_path_factory.mktemp("no-model")


@pytest.fixture(scope="module")
def up():
    yield from serving(FuzzUpstream())


@pytest.fixture
def r(up, start_recorder):
    return start_recorder(up.url, tokenizer_dir=None)


def _stored(r) -> list[tuple[str, int]]:
    t = r.store().read_calls(columns=["trajectory_id", "call_index"])
    return sorted(zip(t.column("trajectory_id").to_pylist(), t.column("call_index").to_pylist()))


def test_the_sources_are_named_in_priority_order():
    assert list(SESSION_SOURCES) == ["trajectory_header", "session_header", "session_url"]


@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.parametrize("source", ["trajectory_header", "session_header", "session_header_lower", "session_url"])
def test_each_source_groups_the_calls_of_a_run(r, path, source):
    headers, url = {}, path
    if source == "trajectory_header":
        headers = {"X-Trajectory-Id": "run-1"}
    elif source == "session_header":
        headers = {"X-Session-ID": "run-1"}
    elif source == "session_header_lower":
        headers = {"x-session-id": "run-1"}
    else:
        url = "/s/run-1" + path
    for i in range(3):
        resp = r.http.post(url, json=ROUTES[path], headers=headers)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-trajectory-id"] == "run-1" and resp.headers["x-call-index"] == str(i)
        assert resp.headers["x-prodrl-recorded"] == "true"
    assert _stored(r) == [("run-1", 0), ("run-1", 1), ("run-1", 2)]
    counter = "session_source_" + source.removesuffix("_lower")
    assert r.stats()[counter] == 3


def test_the_first_source_present_decides(r):
    url = "/s/from-url/v1/chat/completions"
    cases = [({"X-Trajectory-Id": "from-tid", "X-Session-Id": "from-header"}, url, "from-tid"),
             ({"X-Trajectory-Id": "from-tid"}, url, "from-tid"),
             ({"X-Session-Id": "from-header"}, url, "from-header"),
             ({}, url, "from-url")]
    for headers, path, want in cases:
        resp = r.http.post(path, json=CHAT, headers=headers)
        assert resp.status_code == 200 and resp.headers["x-trajectory-id"] == want, (headers, resp.text)
    generated = r.http.post("/v1/chat/completions", json=CHAT)  # none: a trajectory of its own
    assert generated.status_code == 200 and len(generated.headers["x-trajectory-id"]) == 32
    stats = r.stats()
    assert (stats["session_source_trajectory_header"], stats["session_source_session_header"],
            stats["session_source_session_url"], stats["session_source_none"]) == (2, 1, 1, 1)
    assert {t for t, _ in _stored(r)} == {"from-tid", "from-header", "from-url", generated.headers["x-trajectory-id"]}


@pytest.mark.parametrize("where,value,names", [
    ("X-Session-Id", "", "X-Session-Id must be 1-256 characters"),
    ("X-Session-Id", "s" * 257, "X-Session-Id must be 1-256 characters"),
    ("X-Session-Id", "a b", "X-Session-Id must be"),
    ("X-Session-Id", "caf\u00e9".encode(), "X-Session-Id must be"),
    ("X-Trajectory-Id", "a;b", "X-Trajectory-Id must be"),
    ("url", "", "the session of the URL /s/<session>/v1/... must be"),
    ("url", "s" * 257, "the session of the URL"),
    ("url", "a%20b", "the session of the URL"),
    ("url", "a%3Bb", "the session of the URL"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/completions"])
def test_an_invalid_session_is_a_400_naming_its_source(r, where, value, names, path):
    url, headers = path, {}
    if where == "url":
        url = f"/s/{value}{path}"
    else:
        headers = {where: value}
    resp = r.http.post(url, json=ROUTES[path], headers=headers)
    assert resp.status_code == 400 and names in resp.json()["error"]["message"], resp.text
    assert r.stats()["bad_requests"] == 1 and r.stats().get("recorded_calls", 0) == 0


def test_every_source_present_must_be_valid(r):
    """A valid higher source does not hide a malformed lower one (a misconfigured base URL fails on its
    first call, whatever the headers)."""
    resp = r.http.post("/s/a%20b/v1/chat/completions", json=CHAT, headers={"X-Trajectory-Id": "t"})
    assert resp.status_code == 400 and "the session of the URL" in resp.text
    resp = r.http.post("/v1/chat/completions", json=CHAT, headers={"X-Trajectory-Id": "t", "X-Session-Id": ""})
    assert resp.status_code == 400 and "X-Session-Id" in resp.text
    models = r.http.get("/s/a%20b/v1/models")
    assert models.status_code == 400 and "the session of the URL" in models.text
    assert r.http.post("/s//v1/feedback", json={"reward": 1.0}).status_code == 400


def test_the_openai_client_with_a_session_base_url_records_one_trajectory(r):
    """``OpenAI(base_url=".../s/run-42/v1")``: models, chat (plain and streamed) and Responses calls land
    in one trajectory, in order; feedback under the same base URL defaults to the session."""
    client = openai.OpenAI(base_url=r.srv.url + "/s/run-42/v1", api_key=TOKEN, max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "2+2="}]
    client.chat.completions.create(model=model, messages=msgs, max_tokens=3)
    assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=3, stream=True) if c.choices)
    assert client.responses.create(model=model, input="2+2=", max_output_tokens=3).output_text
    client.close()
    fb = httpx.post(r.srv.url + "/s/run-42/v1/feedback", json={"reward": 0.5}, headers=AUTH)
    assert fb.status_code == 200 and fb.json()["trajectory_id"] == "run-42"
    assert _stored(r) == [("run-42", 0), ("run-42", 1), ("run-42", 2)]
    rewards = r.store().read_rewards()
    assert rewards.column("trajectory_id").to_pylist() == ["run-42"] and rewards.column("reward").to_pylist() == [0.5]
    assert r.stats()["session_source_session_url"] == 3
