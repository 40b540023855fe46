"""The recorder under hostile input: names that become paths, numbers that overflow, upstream answers
that are not answers, streams cut short. Each answer is a JSON error, the service keeps serving, and
nothing acknowledged is lost."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.recorder.ingest import Ingestor
from prodrl_pipelines.recorder.wal import WriteAheadLog, encode_entry
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import MAX_NAME_BYTES, TrajectoryStore
from tests.test_recorder import AUTH, _call_row, direct, fake, serving, start_recorder, upstream  # noqa: F401 - fixtures

BODY = {"prompt": [5, 6, 7], "max_tokens": 3}


def _json_error(resp: httpx.Response, status: int, *fragments: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    msg = resp.json()["error"]["message"]
    for f in fragments:
        assert f in msg, msg


def test_a_policy_version_too_long_for_a_path_is_a_400_and_recording_goes_on(fake, start_recorder):
    r = start_recorder(fake.url, tokenizer_dir=None)
    long = "v" * 241  # the header that stopped all recording: a 256-byte partition directory
    _json_error(r.http.post("/v1/completions", json=BODY, headers={"X-Policy-Version": long}), 400,
                "X-Policy-Version is 241 bytes once URL-encoded, at most 200")
    _json_error(r.http.post("/v1/completions", json=BODY, headers={"X-Policy-Version": ("é" * 40).encode("latin-1")}), 400,
                "240 bytes once URL-encoded")  # the bound is on the encoded name, not the characters
    edge = "v" * MAX_NAME_BYTES
    ok = r.http.post("/v1/completions", json=BODY, headers={"X-Policy-Version": edge, "X-Trajectory-Id": "t"})
    assert ok.status_code == 200 and ok.headers["x-prodrl-recorded"] == "true"
    assert r.http.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "t"}).status_code == 200
    store = r.store()
    assert store.read_calls().num_rows == 2 and edge in store.policy_versions()
    s = r.stats()
    assert s["bad_requests"] == 2 and s.get("flush_errors", 0) == 0


def test_a_logged_row_whose_name_cannot_be_a_path_is_set_aside_on_replay(tmp_path):
    """A WAL written before the bound existed (or by another writer): replay stores the good rows,
    sets the bad one aside (counted) and the recorder starts."""
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    wal.append([encode_entry({"kind": "call", "row": _call_row("a", 0)}),
                encode_entry({"kind": "call", "row": _call_row("a", 1, "v" * 241)}),
                encode_entry({"kind": "call", "row": _call_row("a", 2)})])
    wal.close()
    ing = Ingestor(store, tmp_path / "wal")
    counts = ing.recover()
    assert counts["replayed_calls"] == 3 and WriteAheadLog(tmp_path / "wal").segments() == []
    assert sorted(store.read_calls().column("call_index").to_pylist()) == [0, 2]
    assert ing.stats.as_dict()["rejected_rows"] == 1
    rejected = [k for k in store.blobs.list("") if "rejected" in k]
    assert len(rejected) == 1 and "at most 200" in store.blobs.get_bytes(rejected[0]).decode()
    with pytest.raises(ValueError, match="policy_version is 241 bytes"):  # the store refuses it directly too
        store.write_calls([_call_row("b", 0, "v" * 241)])


def test_numbers_that_overflow_are_400s_on_a_kept_alive_connection(fake, start_recorder):
    r = start_recorder(fake.url, tokenizer_dir=None)
    huge = "9" * 400
    raw = ('{"prompt": [5, 6, 7], "max_tokens": 3, "presence_penalty": %s}' % huge).encode()
    _json_error(r.http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}), 400,
                "integer of 400 digits", "at most 20")
    _json_error(r.http.post("/v1/completions", content=b'{"prompt": [5], "logprobs": ' + b"1" * 25 + b"}",
                            headers={"Content-Type": "application/json"}), 400, "integer of 25 digits")
    ok = r.http.post("/v1/completions", json={**BODY, "seed": 2**63 - 1})  # a 19-digit seed is fine
    assert ok.status_code == 200
    tid = ok.headers["x-trajectory-id"]
    _json_error(r.http.post("/v1/feedback", content=('{"trajectory_id": "%s", "reward": %s}' % (tid, huge)).encode(),
                            headers={"Content-Type": "application/json"}), 400, "integer of 400 digits")
    assert r.http.post("/v1/feedback", json={"trajectory_id": tid, "reward": 1}).status_code == 200
    s = r.stats()
    assert s["bad_requests"] == 2 and s["feedback_bad_requests"] == 1 and s["rewards_recorded"] == 1


class BrokenUpstream:
    """Answers 200 with bodies that are not OpenAI answers, or streams cut before [DONE]."""

    def __init__(self) -> None:
        self.body = {}
        self.app = Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"])])

    async def completions(self, request: Request):
        body = await request.json()
        if body.get("stream"):
            chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None,
                                  "token_ids": [4, 5]}]}

            async def cut():
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if self.body == "bad_chunk":
                    yield b'data: {"choices": "nope"}\n\n'
                    yield b"data: [DONE]\n\n"
                # else: the connection ends here, without [DONE]

            return StreamingResponse(cut(), media_type="text/event-stream")
        return JSONResponse(self.body)


@pytest.fixture
def broken():
    yield from serving(BrokenUpstream())


@pytest.mark.parametrize("answer", [{"choices": "nope"}, [1, 2],
                                    {"choices": [{"index": 0, "text": "x", "token_ids": ["a"],
                                                  "prompt_token_ids": [5, 6, 7], "logprobs": None}]}])
def test_a_malformed_upstream_answer_is_a_502_naming_the_upstream(broken, start_recorder, answer):
    r = start_recorder(broken.url, tokenizer_dir=None)
    broken.body = answer
    _json_error(r.http.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "m"}), 502,
                "the upstream server's answer is malformed")
    assert r.stats()["upstream_bad_answers"] == 1
    assert r.http.get("/health").status_code == 200


@pytest.mark.parametrize("mode", ["cut", "bad_chunk"])
def test_a_cut_stream_ends_with_an_error_event_and_is_recorded_as_failed(broken, start_recorder, mode):
    r = start_recorder(broken.url, tokenizer_dir=None)
    broken.body = mode
    events = []
    with r.http.stream("POST", "/v1/completions", json={**BODY, "stream": True},
                       headers={"X-Trajectory-Id": "s"}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 502 and ("ended before [DONE]" in err["message"] if mode == "cut"
                                    else "stream is malformed" in err["message"])
    store = r.store()
    assert store.read_calls().num_rows == 0  # partial text is not an answer
    s = r.stats()
    reason = "upstream_stream_cut" if mode == "cut" else "upstream_bad_stream"
    assert s[f"unrecordable.{reason}"] == 1 and s["upstream_errors"] == 1
    assert r.rec.ingestor.next_index("s") == 1  # the failed call took its index (stored as skipped)


def test_a_call_whose_client_gave_up_is_not_appended(fake, start_recorder):
    """The official client's timeout and automatic retries: one slow model call used to become calls
    0, 1 and 2 of the trajectory (every attempt was answered upstream and appended). An attempt whose
    client disconnected before the answer is not appended (counted); the agent's next turn is call 0."""
    import openai

    r = start_recorder(fake.url, tokenizer_dir=None)
    # the timeout leaves each attempt time to reach the upstream on a loaded machine
    client = openai.OpenAI(base_url=r.srv.url + "/v1", api_key=AUTH["Authorization"].split()[1], timeout=3,
                           max_retries=2, default_headers={"X-Trajectory-Id": "agent"})
    fake.delay = 300.0  # every attempt is held upstream until the client has given up on it
    try:
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=3)
    finally:
        fake.delay = 0.0  # the upstream answers each abandoned attempt now
    import time

    deadline = time.monotonic() + 120
    while r.stats().get("client_disconnected", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.stats()["client_disconnected"] == 3
    ok = client.with_options(timeout=60).completions.with_raw_response.create(model="m", prompt=[5, 6, 7],
                                                                               max_tokens=3)
    assert ok.headers["x-call-index"] == "0"
    assert r.store().read_calls().column("call_index").to_pylist() == [0]


def test_request_size_limit_is_a_413_before_parsing(fake, start_recorder, upstream):
    """A 20 MB prompt or unknown field is refused by the recorder and by `prodrl serve` at once,
    whether its length is declared or streamed."""
    r = start_recorder(fake.url, tokenizer_dir=None, max_body_bytes=1 << 20)
    big = {**BODY, "junk": "x" * (2 << 20)}
    _json_error(r.http.post("/v1/completions", json=big), 413, "at most 1048576")

    def chunks():
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 1 << 16):
            yield payload[i:i + (1 << 16)]

    _json_error(r.http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                413, "over 1048576 bytes")  # no Content-Length: counted while received
    assert r.http.post("/v1/completions", json=BODY).status_code == 200 and r.stats()["too_large_requests"] == 2
    with httpx.Client(base_url=upstream.url, timeout=60) as direct:  # prodrl serve: 8 MiB by default
        _json_error(direct.post("/v1/completions", json={"model": "v0", "prompt": "1+1=" * (3 << 20)}), 413,
                    "at most 8388608")
        assert direct.get("/health").status_code == 200


def test_the_tokenizer_is_found_without_being_named(upstream, start_recorder, model_dir):
    """`prodrl record --upstream URL` exactly as the README shows it: the served model's tokenizer comes
    from the upstream's /v1/models root, so logprob tokens are text, as in a direct call."""
    r = start_recorder(upstream.url, tokenizer_dir=None)
    body = {"model": "v0", "prompt": [1, 116, 5, 24, 17], "max_tokens": 4, "logprobs": 2, "seed": 3}
    got = r.http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    with httpx.Client(base_url=upstream.url, timeout=60) as direct:
        want = direct.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"] and not any(t.startswith("token_id:") for t in got["tokens"])
    assert r.http.get("/stats").json()["tokenizer"] == str(model_dir)


def test_secrets_stay_out_and_errors_are_json(fake, start_recorder, tmp_path, engine, model_dir):
    from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app

    r = start_recorder(fake.url.replace("http://", "http://user:hunter2@"), tokenizer_dir=None)
    assert "hunter2" not in json.dumps(r.http.get("/stats").json())
    assert r.http.post("/v1/completions", json=BODY).status_code == 200  # URL credentials alone work
    with pytest.raises(ValueError, match="carries credentials and \\$PRODRL_UPSTREAM_API_KEY is set"):
        build_recorder_app(RecorderConfig(upstream="http://u:p@127.0.0.1:1", store_dir=str(tmp_path / "s2"),
                                          token="t", upstream_api_key="k"))
    # the scheme is case-insensitive, the token is not
    token = AUTH["Authorization"].split()[1]
    assert r.http.get("/health", headers={"Authorization": f"bearer {token}"}).status_code == 200
    assert r.http.get("/health", headers={"Authorization": f"Bearer {token.upper()}x"}).status_code == 401
    _json_error(r.http.get("/v2/nothing"), 404, "no route '/v2/nothing'")
    _json_error(r.http.get("/v1/completions"), 405, "GET is not allowed")
    long_id = "t" * 100_000
    resp = r.http.post("/v1/feedback", json={"trajectory_id": long_id, "reward": 1})
    _json_error(resp, 404, "(100000 characters)")
    assert len(resp.content) < 1000  # not echoed back
    # the write-ahead log is as private as the parts
    r.http.post("/v1/completions", json=BODY)
    wal = [p for p in (tmp_path / "store" / "_recorder" / "wal").iterdir()]
    assert wal and all(p.stat().st_mode & 0o077 == 0 for p in wal)


def test_serve_load_model_needs_an_api_key(engine, model_dir):
    from prodrl_pipelines.engines.server import build_app

    with BackgroundServer(build_app(engine, model_dir=model_dir, served_model_name="v0")) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            _json_error(c.post("/v1/load_model", json={"model_dir": str(model_dir)}), 403, "start prodrl serve with --api-key")
            assert c.get("/v1/models").json()["data"][0]["id"] == "v0"


def test_a_killed_writers_temporary_files_are_swept_at_start(fake, start_recorder, tmp_path):
    import os
    import time

    part_dir = tmp_path / "store" / "trajectories" / "policy_version=v0"
    part_dir.mkdir(parents=True)
    old = part_dir / ".tmp-deadbeef-abc"
    old.write_bytes(b"half a parquet file")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    fresh = part_dir / ".tmp-cafe-def"  # another process may be writing it right now
    fresh.write_bytes(b"in flight")
    r = start_recorder(fake.url, tokenizer_dir=None)
    assert not old.exists() and fresh.exists() and r.stats()["orphaned_temporaries_removed"] == 1


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 116, 5, 24, 17, 25, 35, 2, 5], "max_tokens": 24, "top_k": 20, "top_p": 0.9}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "7+5="}], "max_tokens": 24, "top_k": 20}),
])
def test_a_seeded_call_through_the_recorder_samples_what_a_direct_call_samples(upstream, direct, start_recorder,
                                                                              path, body):
    """The recorder asks the upstream for 20 logprobs (chat: 21) and token ids; with a seed and
    top-k <= 20 that used to change every sampled token on prodrl serve."""
    r = start_recorder(upstream.url)
    for seed in range(6):
        want = direct.post(path, json={**body, "seed": seed}).json()["choices"][0]
        got = r.http.post(path, json={**body, "seed": seed}).json()["choices"][0]
        text = (lambda c: c.get("text") if "text" in c else c["message"]["content"])
        assert text(got) == text(want), seed
    assert r.stats()["recorded_calls"] == 6
