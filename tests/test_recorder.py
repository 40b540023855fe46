"""Recorder: proxying, stripping, trajectory grouping, feedback, auth, bad input, WAL replay, kill -9."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from prodrl_pipelines.engines.openai_protocol import (
    completion_logprobs,
    error_body,
    iter_sse_data,
    position_entries,
    token_id_string,
)
from prodrl_pipelines.engines.server import BackgroundServer, build_app
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.lab.episodes import render_prompt
from prodrl_pipelines.recorder.ingest import SKIPPED_PREFIX, Ingestor
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.recorder.wal import WriteAheadLog, encode_entry
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore
from tests.helpers import wait_healthy

EOS = 2
TOKEN = "rec-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [1, 116, 5, 24, 17, 25, 35, 2, 5, 1, 121, 5]
REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def upstream(engine, model_dir):
    app = build_app(engine, model_dir=model_dir, served_model_name="v0", max_logprobs=20, batch_wait_ms=1)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture
def direct(upstream):
    with httpx.Client(base_url=upstream.url, timeout=60) as c:
        yield c


class Running:
    def __init__(self, srv: BackgroundServer, app) -> None:
        self.srv, self.rec = srv, app.state.recorder
        self.http = httpx.Client(base_url=srv.url, timeout=60, headers=AUTH)

    def store(self) -> TrajectoryStore:
        assert self.rec.ingestor.flush(30)
        return self.rec.store

    def stats(self) -> dict:
        return self.http.get("/stats").json()["counters"]

    def stop(self) -> None:
        self.http.close()
        self.srv.stop()


@pytest.fixture
def start_recorder(tmp_path, model_dir):
    started: list[Running] = []

    def start(upstream_url: str, store_dir: Path | None = None, **kw) -> Running:
        kw.setdefault("tokenizer_dir", str(model_dir))
        kw.setdefault("token", "" if kw.get("tokens_file") else TOKEN)
        cfg = RecorderConfig(upstream=upstream_url, store_dir=str(store_dir or tmp_path / "store"), **kw)
        app = build_recorder_app(cfg)
        r = Running(BackgroundServer(app).start(), app)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def _same(a: dict, b: dict) -> None:
    """Equal answers up to the response id and creation time."""
    a, b = dict(a), dict(b)
    for k in ("id", "created"):
        a.pop(k, None), b.pop(k, None)
    if a != b:
        _print_diff(a, b)
    assert a == b


def _events(client: httpx.Client, path: str, body: dict, headers=None) -> tuple[list, list[str], httpx.Headers]:
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
        hdrs = r.headers
    data = list(iter_sse_data(lines))
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]], [line for line in lines if line.startswith(":")], hdrs


# ----------------------------------------------------------------------------- proxying and recording


def test_completion_answer_unchanged_and_record_equals_the_local_engine(upstream, direct, start_recorder, engine):
    r = start_recorder(upstream.url)
    body = {"prompt": PROMPT, "max_tokens": 8, "seed": 5}
    resp = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "t-1", "X-Task-Id": "task-9"})
    assert resp.status_code == 200
    assert resp.headers["x-trajectory-id"] == "t-1" and resp.headers["x-call-index"] == "0"
    assert resp.headers["x-prodrl-recorded"] == "true"
    _same(resp.json(), direct.post("/v1/completions", json=body).json())  # logprobs/ids stripped again
    assert resp.json()["choices"][0]["logprobs"] is None and resp.json()["choices"][0]["token_ids"] is None

    rows = r.store().read_calls().to_pylist()
    assert len(rows) == 1
    row = rows[0]
    want = engine.generate([PROMPT], SamplingParams(max_tokens=8, num_top_logprobs=20, stop_token_ids=(EOS,)),
                           seed=5)[0]
    assert row["trajectory_id"] == "t-1" and row["call_index"] == 0 and row["task_id"] == "task-9"
    assert row["policy_version"] == "v0"  # the upstream's model name
    assert row["prompt_token_ids"] == PROMPT and row["output_token_ids"] == want.output_token_ids
    assert row["output_logprobs"] == pytest.approx(want.output_logprobs, abs=1e-6)
    assert row["top_token_ids"] == want.top_token_ids
    assert [x for r_ in row["top_logprobs"] for x in r_] == pytest.approx(
        [x for r_ in want.top_logprobs for x in r_], abs=1e-6)
    assert row["support_complete"] is False and row["support_complete"] == want.support_complete
    assert (row["temperature"], row["top_p"], row["top_k"]) == (1.0, 1.0, 0)
    assert row["prompt_text"] == engine.tokenizer.decode(PROMPT)
    assert row["output_text"] == resp.json()["choices"][0]["text"]


@pytest.mark.parametrize("as_ids", [False, True])
def test_what_the_client_asked_for_is_passed_through_exactly(upstream, direct, start_recorder, as_ids):
    r = start_recorder(upstream.url)
    body = {"prompt": PROMPT, "max_tokens": 6, "seed": 7, "logprobs": 3, "return_token_ids": True,
            "top_k": 40, "return_tokens_as_token_ids": as_ids}
    _same(r.http.post("/v1/completions", json=body).json(), direct.post("/v1/completions", json=body).json())
    chat = {"messages": [{"role": "user", "content": "4+4="}], "max_tokens": 6, "seed": 2, "logprobs": True,
            "top_logprobs": 2, "return_tokens_as_token_ids": as_ids}
    _same(r.http.post("/v1/chat/completions", json=chat).json(), direct.post("/v1/chat/completions", json=chat).json())
    row = r.store().read_calls().to_pylist()[0]
    assert row["top_k"] == 40 and row["support_complete"] is False  # 40 > K = 20


def test_streams_are_passed_through_and_recorded(upstream, direct, start_recorder, engine):
    r = start_recorder(upstream.url)
    chat = {"messages": [{"role": "user", "content": "9+1="}], "max_tokens": 7, "seed": 4,
            "stream_options": {"include_usage": True}}
    got, comments, hdrs = _events(r.http, "/v1/chat/completions", chat, {"X-Trajectory-Id": "s-1"})
    want, _, _ = _events(direct, "/v1/chat/completions", chat)
    assert [{k: v for k, v in c.items() if k not in ("id", "created")} for c in got] == \
        [{k: v for k, v in c.items() if k not in ("id", "created")} for c in want]
    assert hdrs["x-trajectory-id"] == "s-1"
    assert comments == [": prodrl trajectory_id=s-1 call_index=0 recorded=true"]
    comp = {"prompt": PROMPT, "max_tokens": 5, "seed": 8, "logprobs": 1}
    got, comments, _ = _events(r.http, "/v1/completions", comp, {"X-Trajectory-Id": "s-1"})
    want, _, _ = _events(direct, "/v1/completions", comp)
    assert [c["choices"] for c in got] == [c["choices"] for c in want]
    assert comments == [": prodrl trajectory_id=s-1 call_index=1 recorded=true"]

    rows = sorted(r.store().read_calls().to_pylist(), key=lambda x: x["call_index"])
    text, ids = render_prompt(engine.tokenizer, chat["messages"])
    assert rows[0]["prompt_token_ids"] == ids and rows[0]["prompt_text"] == text
    p = SamplingParams(max_tokens=7, num_top_logprobs=20, stop_token_ids=(EOS,))
    rec = engine.generate([ids], p, seed=4)[0]
    assert rows[0]["output_token_ids"] == rec.output_token_ids
    assert rows[0]["top_token_ids"] == [h[:19] for h in rec.top_token_ids]  # chat head: K + 1 asked, 19 kept
    assert rows[0]["output_logprobs"] == pytest.approx(rec.output_logprobs, abs=1e-6)
    p5 = SamplingParams(max_tokens=5, num_top_logprobs=20, stop_token_ids=(EOS,))
    assert rows[1]["output_token_ids"] == engine.generate([PROMPT], p5, seed=8)[0].output_token_ids


@pytest.mark.parametrize("kind,stream", [("completion", False), ("completion", True), ("chat", False), ("chat", True)])
def test_recorded_extra_draw_equals_the_local_engine(upstream, direct, start_recorder, engine, kind, stream):
    """``--record-extra-draw``: the recorder asks ``prodrl serve`` for the extra draw, records it as
    ``extra_token_ids`` (equal to the local engine's for the same seed) and strips it from the answer."""
    r = start_recorder(upstream.url, record_extra_draw=True)
    if kind == "completion":
        path, body, ids = "/v1/completions", {"prompt": PROMPT, "max_tokens": 9, "seed": 12, "top_k": 50}, PROMPT
    else:
        messages = [{"role": "user", "content": "8+5="}]
        path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": 9, "seed": 12, "top_k": 50}
        ids = render_prompt(engine.tokenizer, messages)[1]
    # what the upstream sampled: the same request with the extra draw, seeded
    want_answer = direct.post(path, json={**body, "extra_draw": True}).json()
    for c in want_answer["choices"]:
        c.pop("extra_token_ids")
    if stream:
        got, comments, _ = _events(r.http, path, body, {"X-Trajectory-Id": "x"})
        assert comments == [": prodrl trajectory_id=x call_index=0 recorded=true"]
        assert all("extra_token_ids" not in ch for c in got for ch in c["choices"])  # stripped from every chunk
    else:
        resp = r.http.post(path, json=body, headers={"X-Trajectory-Id": "x"})
        assert resp.headers["x-prodrl-recorded"] == "true"
        _same(resp.json(), want_answer)  # the client's answer: nothing it did not ask for
    want = engine.generate([ids], SamplingParams(max_tokens=9, top_k=50, num_top_logprobs=20, stop_token_ids=(EOS,),
                                                 record_extra_draw=True), seed=12)[0]
    row = r.store().read_calls().to_pylist()[0]
    assert row["output_token_ids"] == want.output_token_ids
    assert row["extra_token_ids"] == want.extra_token_ids and len(row["extra_token_ids"]) == len(want.output_token_ids)
    assert r.stats()["extra_draw_recorded"] == 1 and r.http.get("/stats").json()["record_extra_draw"] is True


def test_extra_draw_strip_rule(upstream, direct, start_recorder, engine):
    """The client gets ``extra_token_ids`` only when it asked (``extra_draw``); what it asked for is
    recorded too, with or without the recorder's flag; without either nothing is asked upstream."""
    body = {"prompt": PROMPT, "max_tokens": 6, "seed": 3, "top_k": 30}
    want = direct.post("/v1/completions", json={**body, "extra_draw": True}).json()["choices"][0]["extra_token_ids"]
    plain = start_recorder(upstream.url)
    got = plain.http.post("/v1/completions", json={**body, "extra_draw": True}, headers={"X-Trajectory-Id": "a"})
    assert got.json()["choices"][0]["extra_token_ids"] == want
    no = plain.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "a"}).json()["choices"][0]
    assert "extra_token_ids" not in no
    _same(no, direct.post("/v1/completions", json=body).json()["choices"][0])  # no extra draw asked upstream
    rows = sorted(plain.store().read_calls().to_pylist(), key=lambda x: x["call_index"])
    assert [x["extra_token_ids"] for x in rows] == [want, None]
    flagged = start_recorder(upstream.url, record_extra_draw=True, store_dir=Path(plain.rec.cfg.store_dir + "-2"))
    asked = flagged.http.post("/v1/completions", json={**body, "extra_draw": True, "stream": False})
    assert asked.json()["choices"][0]["extra_token_ids"] == want
    chunks, _, _ = _events(flagged.http, "/v1/completions", {**body, "extra_draw": True})
    assert sum((c["choices"][0]["extra_token_ids"] for c in chunks if c["choices"]), []) == want


def test_trajectories_group_calls_in_order(upstream, start_recorder):
    r = start_recorder(upstream.url, policy_version="round-7")
    body = {"prompt": PROMPT, "max_tokens": 2}
    idx = [r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "multi"}).headers["x-call-index"]
           for _ in range(3)]
    assert idx == ["0", "1", "2"]
    fresh = r.http.post("/v1/completions", json=body, headers={"X-Policy-Version": "canary"})
    tid = fresh.headers["x-trajectory-id"]
    assert len(tid) == 32 and fresh.headers["x-call-index"] == "0"
    assert r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "bad id!"}).status_code == 400
    rows = r.store().read_calls().to_pylist()
    by = {(x["trajectory_id"], x["call_index"]): x["policy_version"] for x in rows}
    assert by == {("multi", 0): "round-7", ("multi", 1): "round-7", ("multi", 2): "round-7", (tid, 0): "canary"}


def test_feedback(upstream, start_recorder):
    r = start_recorder(upstream.url)
    r.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers={"X-Trajectory-Id": "fb"})
    ok = r.http.post("/v1/feedback", json={"trajectory_id": "fb", "reward": 0.5, "source": "grader"})
    assert ok.status_code == 200 and ok.json()["reward"] == 0.5
    assert r.http.post("/v1/feedback", json={"trajectory_id": "nope", "reward": 1}).status_code == 404
    for raw in (b'{"trajectory_id": "fb", "reward": NaN}', b'{"trajectory_id": "fb", "reward": Infinity}',
                b'{"trajectory_id": "fb"}', b'{"trajectory_id": "fb", "reward": true}',
                b'{"trajectory_id": "fb", "reward": "1"}', b'{"reward": 1}', b'{"trajectory_id": "fb", "reward": 1, "source": 3}'):
        assert r.http.post("/v1/feedback", content=raw).status_code == 422, raw
    assert r.http.post("/v1/feedback", content=b"{oops").status_code == 400
    rewards = r.store().read_rewards(latest=False).to_pylist()
    assert [(x["trajectory_id"], x["reward"], x["source"]) for x in rewards] == [("fb", 0.5, "grader")]
    s = r.stats()
    assert s["rewards_recorded"] == 1 and s["feedback_unknown_trajectory"] == 1 and s["feedback_invalid"] == 7


def test_every_route_needs_the_bearer_token(upstream, start_recorder):
    r = start_recorder(upstream.url)
    with httpx.Client(base_url=r.srv.url, timeout=30) as anon:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("POST", "/v1/feedback"), ("GET", "/stats"), ("GET", "/health")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                resp = anon.request(method, path, json={"prompt": PROMPT, "max_tokens": 2}, headers=headers)
                assert resp.status_code == 401, (method, path, headers)
        # a Prometheus scrape needs no token (like vLLM's /metrics); it holds counts, no content
        scrape = anon.get("/metrics")
    s = r.stats()
    assert s["unauthorized"] == 18 and "requests" not in s and "recorded_calls" not in s
    assert r.store().read_calls().num_rows == 0
    assert r.http.get("/v1/models").json()["data"][0]["id"] == "v0"
    assert r.http.get("/health").status_code == 200
    assert scrape.status_code == 200 and "prodrl_recorder_unauthorized_total 18.0" in scrape.text
    assert 'prodrl_recorder_responses_total{code="401",route="/v1/completions"} 3.0' in scrape.text


def test_malformed_json_and_upstream_errors_pass_through(upstream, start_recorder):
    r = start_recorder(upstream.url)
    for raw in (b"{nope", b"[1]"):
        resp = r.http.post("/v1/completions", content=raw, headers={"X-Trajectory-Id": "e"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == 400
    too_many = r.http.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 25}, headers={"X-Trajectory-Id": "e"})
    assert too_many.status_code == 400 and "max allowed: 20" in too_many.json()["error"]["message"]
    ok = r.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers={"X-Trajectory-Id": "e"})
    assert ok.status_code == 200 and ok.headers["x-call-index"] == "0"  # errors took no index
    s = r.stats()
    assert s["bad_requests"] == 2 and s["upstream_errors"] == 1 and s["recorded_calls"] == 1


# ----------------------------------------------------------------------------- a scriptable fake upstream


class FakeUpstream:
    """A vLLM-shaped /v1/completions whose failure modes the tests switch on."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.extra = None  # None: ignores ``extra_draw`` (like vLLM); else the extra_token_ids it returns
        self.routing = None  # None: no ``routed_experts``; else the value it returns
        self.delay = 0.0
        self.app = Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                                     Route("/v1/models", self.models, methods=["GET"])])

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-v3", "object": "model"}]})

    async def completions(self, request: Request):
        body = await request.json()
        end = time.monotonic() + self.delay
        while self.delay and time.monotonic() < end:  # setting ``delay`` to 0 releases a waiting answer
            await asyncio.sleep(0.02)
        if self.mode == "error":
            return JSONResponse(error_body("upstream says no", 400), status_code=400)
        prompt = body["prompt"]
        n_lp = body.get("logprobs")
        seed = body.get("seed") or 0
        choices = []
        for c in range(body.get("n") or 1):
            ids = [(seed + 7 * t + 3 * c + len(prompt)) % 40 + 3 for t in range(body.get("max_tokens", 4))]
            positions = [position_entries(t, -1.0, [(t + j) % 40 + 3 for j in range(25)],
                                          [-1.0 - 0.1 * j for j in range(25)], n_lp or 0) for t in ids]
            lp = None
            if n_lp is not None and self.mode != "no_logprobs":
                as_ids = body.get("return_tokens_as_token_ids")
                lp = completion_logprobs(ids, positions, n_lp, token_id_string if as_ids else str)
            rti = body.get("return_token_ids") and self.mode != "no_ids"
            choices.append({"index": c, "text": "x" * len(ids), "logprobs": lp, "finish_reason": "length",
                            "stop_reason": None, "token_ids": ids if rti else None,
                            "prompt_token_ids": prompt if rti else None})
            if self.extra is not None:
                choices[-1]["extra_token_ids"] = self.extra
            if self.routing is not None:
                choices[-1]["routed_experts"] = self.routing
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "fake-v3",
                             "choices": choices, "usage": None})


def serving(upstream):
    """Serve a scriptable upstream (its ``app``) on loopback for one test; sets its ``url``."""
    with BackgroundServer(upstream.app) as srv:
        upstream.url = srv.url
        yield upstream


@pytest.fixture
def fake():
    yield from serving(FakeUpstream())


def test_unrecordable_calls_are_answered_counted_and_never_stored(fake, start_recorder, tmp_path):
    r = start_recorder(fake.url, tokenizer_dir=None)
    H = {"X-Trajectory-Id": "u"}
    body = {"prompt": [5, 6, 7], "max_tokens": 3}
    for mode, want_index in (("no_ids", "0"), ("no_logprobs", "1"), ("ok", "2")):
        fake.mode = mode
        resp = r.http.post("/v1/completions", json=body, headers=H)
        assert resp.status_code == 200 and resp.headers["x-call-index"] == want_index
        assert resp.json()["choices"][0]["text"] == "xxx"
        assert resp.headers["x-prodrl-recorded"] == ("true" if mode == "ok" else "false")
    two = r.http.post("/v1/completions", json={**body, "n": 2}, headers=H)
    assert len(two.json()["choices"]) == 2 and two.headers["x-prodrl-recorded"] == "false"
    pen = r.http.post("/v1/completions", json={**body, "presence_penalty": 0.3}, headers=H)
    assert pen.headers["x-prodrl-recorded"] == "false"
    s = r.stats()
    assert s["unrecordable.upstream_missing_token_ids"] == 1 and s["unrecordable.upstream_missing_logprobs"] == 1
    assert s["unrecordable.n>1"] == 1 and s["unrecordable.unsupported:presence_penalty"] == 1
    assert s["unrecordable_calls"] == 4 and s["recorded_calls"] == 1
    store = r.store()
    rows = store.read_calls().to_pylist()
    assert [(x["call_index"], x["policy_version"]) for x in rows] == [(2, "fake-v3")]
    skipped = [s_ for k in store.blobs.list(SKIPPED_PREFIX) for s_ in json.loads(store.blobs.get_bytes(k))]
    assert sorted(x["call_index"] for x in skipped) == [0, 1, 3, 4]
    r.stop()
    again = start_recorder(fake.url, tokenizer_dir=None)  # a restart keeps the trajectory's next index
    assert again.http.post("/v1/completions", json=body, headers=H).headers["x-call-index"] == "5"


def test_extra_draw_against_an_upstream_without_the_extension(fake, start_recorder):
    """A vLLM-like upstream ignores ``extra_draw``: the call is answered and recorded with a null
    ``extra_token_ids``, and counted; extra ids of the wrong length are dropped the same way."""
    r = start_recorder(fake.url, tokenizer_dir=None, record_extra_draw=True)
    body = {"prompt": [5, 6, 7], "max_tokens": 3}
    for extra in (None, [1, 2], [1, 2, "x"], [4, 5, 6]):
        fake.extra = extra
        resp = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "v"})
        assert resp.status_code == 200 and resp.headers["x-prodrl-recorded"] == "true"
        assert "extra_token_ids" not in resp.json()["choices"][0]
    rows = sorted(r.store().read_calls().to_pylist(), key=lambda x: x["call_index"])
    assert [x["extra_token_ids"] for x in rows] == [None, None, None, [4, 5, 6]]
    s = r.stats()
    assert s["extra_draw_missing"] == 1 and s["extra_draw_malformed"] == 2 and s["extra_draw_recorded"] == 1
    assert s["recorded_calls"] == 4 and "prodrl_recorder_extra_draw_missing_total 1.0" in r.http.get("/metrics").text


def test_upstream_timeout_is_a_504_and_the_service_keeps_serving(fake, start_recorder):
    # the timeout also bounds the answered calls after it: long enough for a loaded machine
    r = start_recorder(fake.url, upstream_timeout_s=5, tokenizer_dir=None)
    body = {"prompt": [5, 6], "max_tokens": 2}
    fake.delay = 300.0  # held until released below, whatever the timeout
    slow = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "to"})
    assert slow.status_code == 504 and slow.json()["error"]["code"] == 504
    fake.delay = 0.0
    fake.mode = "error"
    err = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "to"})
    assert err.status_code == 400 and err.json()["error"]["message"] == "upstream says no"
    fake.mode = "ok"
    ok = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "to"})
    assert ok.status_code == 200 and ok.headers["x-call-index"] == "0"
    s = r.stats()
    assert s["upstream_timeouts"] == 1 and s["upstream_errors"] == 1
    down = start_recorder("http://127.0.0.1:9", tokenizer_dir=None, store_dir=r.rec.cfg.store_dir + "-2")
    assert down.http.post("/v1/completions", json=body).status_code == 502


class DroppingProxy:
    """A TCP proxy in front of ``target`` that resets the connection of the next ``drop`` requests as
    they come in, unanswered (a keep-alive connection closed under a request), and cuts the next
    ``cut`` answers after their headers and a few bytes of body (a server killed mid-answer)."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.drop, self.dropped, self.cut, self.cuts = target_port, 0, 0, 0, 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main():
            self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            started.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(main()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        assert started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def handle(self, reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(r, w, requests: bool):
            try:
                while data := await r.read(65536):
                    if requests and self.drop > 0:  # a request arrived: reset the connection, unanswered
                        self.drop -= 1
                        self.dropped += 1
                        writer.transport.abort()
                        up_w.transport.abort()
                        return
                    if not requests and self.cut > 0 and (head := data.find(b"\r\n\r\n")) >= 0:
                        self.cut -= 1
                        self.cuts += 1
                        w.write(data[:head + 8])  # the status, the headers, 4 bytes of the body
                        await w.drain()
                        w.transport.abort()
                        return
                    w.write(data)
                    await w.drain()
            except ConnectionError:
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False))

    def close(self) -> None:
        async def shutdown():
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_a_connection_reset_under_a_request_is_retried_once(fake, start_recorder):
    proxy = DroppingProxy(int(fake.url.rsplit(":", 1)[1]))
    try:
        r = start_recorder(proxy.url, tokenizer_dir=None)
        body = {"prompt": [5, 6, 7], "max_tokens": 3}
        proxy.drop = 1
        ok = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "rt"})
        assert ok.status_code == 200 and ok.headers["x-call-index"] == "0" and proxy.dropped == 1
        proxy.drop = 1  # a stream is retried the same way (this fake answers it with plain JSON, not a
        # stream: the client gets an error event, and the failed call takes index 1, stored as skipped)
        stream = r.http.post("/v1/completions", json={**body, "stream": True}, headers={"X-Trajectory-Id": "rt"})
        assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n") and proxy.dropped == 2
        assert "ended before [DONE]" in stream.text
        proxy.drop = 2  # the retry is reset too: a 502, nothing recorded, no index taken
        bad = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "rt"})
        assert bad.status_code == 502 and proxy.dropped == 4
        assert r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "rt"}).headers["x-call-index"] == "2"
        s = r.stats()
        assert s["upstream_retries"] == 3 and s["upstream_unreachable"] == 1 and s["recorded_calls"] == 2
        assert sorted(x["call_index"] for x in r.store().read_calls().to_pylist()) == [0, 2]
    finally:
        proxy.close()


def test_an_answer_cut_mid_body_is_asked_again_and_recorded_once(fake, start_recorder):
    """Its server killed after the headers (a replica or node gone): nothing reached the client or the
    store, so the call is asked again; cut twice, a 502 and no index taken."""
    proxy = DroppingProxy(int(fake.url.rsplit(":", 1)[1]))
    try:
        r = start_recorder(proxy.url, tokenizer_dir=None)
        body = {"prompt": [5, 6, 7], "max_tokens": 3}
        proxy.cut = 1
        ok = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "cut"})
        assert ok.status_code == 200 and ok.headers["x-call-index"] == "0" and proxy.cuts == 1
        proxy.cut = 2
        bad = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "cut"})
        assert bad.status_code == 502 and proxy.cuts == 3
        assert r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "cut"}).headers["x-call-index"] == "1"
        s = r.stats()
        assert s["upstream_retries"] == 2 and s["upstream_unreachable"] == 1 and s["recorded_calls"] == 2
        assert sorted(x["call_index"] for x in r.store().read_calls().to_pylist()) == [0, 1]
    finally:
        proxy.close()


# ----------------------------------------------------------------------------- durability


def _call_row(tid: str, index: int, version: str = "v0") -> dict:
    return {"trajectory_id": tid, "call_index": index, "task_id": None, "policy_version": version,
            "prompt_token_ids": [1, 2], "output_token_ids": [3], "output_logprobs": [-0.5],
            "top_token_ids": [[3, 4]], "top_logprobs": [[-0.5, -1.0]], "support_complete": False,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "prompt_text": "p", "output_text": "o",
            "created_at": 1_700_000_000_000_000 + index}


def test_wal_frames_detect_a_torn_tail(tmp_path):
    wal = WriteAheadLog(tmp_path / "wal")
    first = wal.open()
    wal.append([encode_entry({"kind": "x", "i": i}) for i in range(3)])
    sealed = wal.rotate()
    assert sealed == first and wal.current != first
    wal.close()
    with open(first, "ab") as f:
        f.write(encode_entry({"kind": "x", "i": 3})[:-5])  # a write cut short by a crash
    seg = WriteAheadLog.read_segment(first)
    assert [e["i"] for e in seg.entries] == [0, 1, 2] and seg.torn
    data = bytearray(first.read_bytes())
    data[25] ^= 0xFF  # corrupt the first payload: nothing after it is trusted
    first.write_bytes(bytes(data))
    assert WriteAheadLog.read_segment(first).entries == []


@pytest.fixture(params=["local", "s3"])
def replay_blobs(request, tmp_path):
    """The store the recorder writes to: a local directory or an S3 bucket (moto)."""
    if request.param == "local":
        return LocalBlobStore(tmp_path / "store")
    from prodrl_pipelines.storage.s3 import S3BlobStore

    return S3BlobStore(request.getfixturevalue("bucket"), "prod",
                       endpoint_url=request.getfixturevalue("s3_endpoint"), region="us-east-1")


def test_replay_writes_every_logged_record_exactly_once(tmp_path, replay_blobs):
    """Start-up replay dedupes against the stored parts (by call id) through the BlobStore, local or S3."""
    store = TrajectoryStore(replay_blobs)
    store.write_calls([_call_row("a", 0), _call_row("a", 1)])  # flushed before the crash ...
    store.write_rewards([{"trajectory_id": "a", "reward": 1.0, "source": "s", "created_at": 1_700_000_000_000_123}])
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    wal.append([encode_entry({"kind": "call", "row": _call_row("a", 0)}),  # ... but its segment not yet deleted
                encode_entry({"kind": "call", "row": _call_row("a", 1)}),
                encode_entry({"kind": "reward", "row": {"trajectory_id": "a", "reward": 1.0, "source": "s",
                                                        "created_at": 1_700_000_000_000_123}})])
    wal.rotate()
    wal.append([encode_entry({"kind": "call", "row": _call_row("a", 2)}),
                encode_entry({"kind": "skip", "trajectory_id": "b", "call_index": 0, "reason": "n>1",
                              "created_at": 1}),
                encode_entry({"kind": "call", "row": _call_row("b", 1, "v1")}),
                encode_entry({"kind": "reward", "row": {"trajectory_id": "b", "reward": -1.0, "source": "s",
                                                        "created_at": 1_700_000_000_000_999}})])
    wal.close()
    with open(wal.segments()[-1], "ab") as f:
        f.write(b"0000004a deadbeef {\"kind\":")  # torn tail: ignored
    ing = Ingestor(store, tmp_path / "wal")
    counts = ing.recover()
    assert counts["replayed_calls"] == 2 and counts["replayed_rewards"] == 1 and counts["replayed_skips"] == 1
    assert counts["replay_duplicates"] == 3 and counts["wal_torn_tails"] == 1
    assert WriteAheadLog(tmp_path / "wal").segments() == []
    calls = store.read_calls(dedupe=False)
    keys = Counter(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist()))
    assert keys == {("a", 0): 1, ("a", 1): 1, ("a", 2): 1, ("b", 1): 1}
    assert sorted(store.read_rewards(latest=False).column("reward").to_pylist()) == [-1.0, 1.0]
    assert ing.next_index("a") == 3 and ing.next_index("b") == 2 and ing.known("b") and not ing.known("c")
    # a second recovery finds nothing left to do
    assert Ingestor(store, tmp_path / "wal").recover()["replayed_calls"] == 0


def test_config_needs_exactly_one_store_and_a_local_wal_for_s3(tmp_path):
    with pytest.raises(ValueError, match="exactly one trajectory store"):
        RecorderConfig(upstream="http://x", store_dir="", token=TOKEN)
    with pytest.raises(ValueError, match="exactly one trajectory store"):
        RecorderConfig(upstream="http://x", store_dir=str(tmp_path), token=TOKEN, s3_bucket="b")
    with pytest.raises(ValueError, match="--wal-dir"):
        RecorderConfig(upstream="http://x", store_dir="", token=TOKEN, s3_bucket="b")
    cfg = RecorderConfig(upstream="http://x", store_dir="", token=TOKEN, s3_bucket="b", s3_prefix="p",
                         s3_endpoint_url="http://127.0.0.1:9", s3_region="us-east-1", wal_dir=str(tmp_path / "w"))
    blobs = cfg.blob_store()
    assert (blobs.bucket, blobs.prefix, blobs.endpoint_url, blobs.region) == ("b", "p", "http://127.0.0.1:9",
                                                                                "us-east-1")
    assert cfg.wal_path == str(tmp_path / "w")
    local = RecorderConfig(upstream="http://x", store_dir=str(tmp_path / "s"), token=TOKEN)
    assert local.blob_store().root == tmp_path / "s" and local.wal_path == str(tmp_path / "s" / "_recorder" / "wal")


def test_flushes_by_count_and_by_time(tmp_path):
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    ing = Ingestor(store, tmp_path / "wal", flush_rows=3, flush_interval_s=3600)
    ing.start()
    futs = [ing.commit_call("c", {k: v for k, v in _call_row("c", 0).items()
                                  if k not in ("trajectory_id", "call_index", "created_at")})[1] for _ in range(3)]  # (index, future, retried)
    for f in futs:
        f.result(10)
    deadline = time.monotonic() + 120
    while store.read_calls().num_rows < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.read_calls().column("call_index").to_pylist() == [0, 1, 2]
    ing.stop()
    timed = Ingestor(store, tmp_path / "wal", flush_rows=10_000, flush_interval_s=0.05)
    timed.start()
    timed.commit_reward("c", 2.0, "s")[1].result(10)
    deadline = time.monotonic() + 120
    while store.read_rewards().num_rows < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.read_rewards().column("reward").to_pylist() == [2.0]
    timed.stop()
    assert WriteAheadLog(tmp_path / "wal").segments() == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_recorder(upstream_url: str, store: Path | list[str], port: int, *flush: str) -> subprocess.Popen:
    """A `prodrl record` process; ``store`` is a local directory or the store flags (S3, --wal-dir)."""
    env = {**os.environ, "PRODRL_RECORDER_TOKEN": TOKEN}
    where = store if isinstance(store, list) else ["--store", str(store)]
    cmd = [sys.executable, "-m", "prodrl_pipelines.cli", "record", "--upstream", upstream_url, *where,
           "--port", str(port), *(flush or ("--flush-rows", "25", "--flush-interval", "0.1"))]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return wait_healthy(proc, f"http://127.0.0.1:{port}/health", AUTH, 60, "the recorder")


def kill_under_load(proc, client, acked, n: int = 150, workers: int = 8, wait_s: float = 600) -> None:
    """Run ``client(w, stop)`` in ``workers`` threads until ``acked`` holds ``n`` entries (or
    ``wait_s``: a ceiling only, for a slow loaded machine), then kill -9 ``proc`` (a process or a
    list of them) and let the clients see it go."""
    procs = proc if isinstance(proc, list) else [proc]
    stop = threading.Event()
    with ThreadPoolExecutor(workers) as pool:
        futs = [pool.submit(client, w, stop) for w in range(workers)]
        deadline = time.monotonic() + wait_s
        while len(acked) < n and time.monotonic() < deadline and not all(f.done() for f in futs):
            time.sleep(0.01)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(10)
        stop.set()
        for f in futs:
            f.result(30)


class LoadClients:
    """Clients recording 2-call trajectories with a reward each, remembering what was acknowledged:
    ``acked_calls`` (trajectory, call index) and ``acked_rewards`` (trajectory, created_at_us).
    Worker ``w`` talks to ``ports[w % len(ports)]`` (a trajectory stays on one recorder)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.acked_calls: set[tuple[str, int]] = set()
        self.acked_rewards: set[tuple[str, int]] = set()
        self.lock = threading.Lock()

    def __call__(self, w: int, stop: threading.Event) -> None:
        port = self.ports[w % len(self.ports)]
        # a client that times out leaves the load for good: wait as long as a loaded machine may need
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=120) as c:
            i = 0
            while not stop.is_set():
                tid = f"w{w}-{i}"
                try:
                    for call in range(2):
                        resp = c.post("/v1/completions", json={"prompt": [w, i, call], "max_tokens": 3, "seed": i},
                                      headers={"X-Trajectory-Id": tid})
                        if resp.status_code != 200:
                            return
                        with self.lock:
                            self.acked_calls.add((tid, int(resp.headers["x-call-index"])))
                    fb = c.post("/v1/feedback", json={"trajectory_id": tid, "reward": float(i % 3)})
                    if fb.status_code != 200:
                        return
                    with self.lock:
                        self.acked_rewards.add((tid, fb.json()["created_at_us"]))
                except httpx.HTTPError:
                    return  # the recorder is gone
                i += 1


def assert_stored_exactly_once(store: TrajectoryStore, load: LoadClients) -> Counter:
    """Every acknowledged call and reward is in ``store`` once, and nothing is there twice."""
    calls = store.read_calls(dedupe=False, columns=["trajectory_id", "call_index"])
    counts = Counter(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist()))
    assert all(counts[k] == 1 for k in load.acked_calls), "an acknowledged call is missing or duplicated"
    assert max(counts.values()) == 1  # nothing at all twice
    rewards = store.read_rewards(latest=False)
    rcount = Counter(zip(rewards.column("trajectory_id").to_pylist(),
                         rewards.column("created_at").cast(pa.int64()).to_pylist()))
    assert all(rcount[k] == 1 for k in load.acked_rewards) and max(rcount.values()) == 1
    return counts


def test_sigkill_under_load_loses_no_acknowledged_record(fake, tmp_path):
    """kill -9 while 8 clients record calls and rewards; after a restart every acknowledged call and
    reward is in the store exactly once."""
    store_dir = tmp_path / "store"
    port = _free_port()
    proc = _spawn_recorder(fake.url, store_dir, port)
    load = LoadClients([port])
    kill_under_load(proc, load, load.acked_calls)
    assert len(load.acked_calls) >= 150 and load.acked_rewards

    proc = _spawn_recorder(fake.url, store_dir, port)  # replays the WAL before it listens
    try:
        counts = assert_stored_exactly_once(TrajectoryStore(LocalBlobStore(store_dir)), load)
        stats = httpx.get(f"http://127.0.0.1:{port}/stats", headers=AUTH).json()["counters"]
        assert stats["replayed_segments"] >= 1
        print("after kill -9:", len(load.acked_calls), "acknowledged calls,", len(load.acked_rewards), "rewards;", stats)
        # the restarted recorder continues every trajectory after its last index
        tid = max(load.acked_calls)[0]
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={**AUTH, "X-Trajectory-Id": tid},
                          json={"prompt": [1], "max_tokens": 2})
        assert int(resp.headers["x-call-index"]) == max(i for t, i in counts if t == tid) + 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _spawn_replica(upstream_url: str, port: int, s3_endpoint: str, bucket: str, wal: Path) -> subprocess.Popen:
    return _spawn_recorder(upstream_url, ["--s3-bucket", bucket, "--s3-prefix", "store", "--s3-endpoint-url",
                                          s3_endpoint, "--wal-dir", str(wal)], port)


def test_two_replicas_on_one_s3_store_sigkill_under_load_store_every_call_once(fake, tmp_path, s3_endpoint, bucket):
    """Two recorders (one per serving replica, each its own WAL) append to one S3 store at once, under
    load from 8 clients (a trajectory stays on its replica); both are killed -9, restarted, and every
    acknowledged call and reward is in the store exactly once."""
    from prodrl_pipelines.storage.s3 import S3BlobStore

    ports = [_free_port(), _free_port()]
    wals = [tmp_path / "wal-a", tmp_path / "wal-b"]
    procs = [_spawn_replica(fake.url, p, s3_endpoint, bucket, w) for p, w in zip(ports, wals)]
    load = LoadClients(ports)
    kill_under_load(procs, load, load.acked_calls, n=200)
    assert len(load.acked_calls) >= 200 and load.acked_rewards
    procs = [_spawn_replica(fake.url, p, s3_endpoint, bucket, w) for p, w in zip(ports, wals)]  # replay both WALs
    try:
        store = TrajectoryStore(S3BlobStore(bucket, "store", endpoint_url=s3_endpoint))
        assert_stored_exactly_once(store, load)
        # each replica's commits carry its own WAL identity
        writers = {WriteAheadLog(w).writer_id() for w in wals}
        assert len(writers) == 2 and all(store.tables.txn_version("calls", wid) for wid in writers)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _print_diff(a, b, path=""):
    """Print where two JSON values differ (pytest's diff of long nested answers is hard to read)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            _print_diff(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _print_diff(x, y, f"{path}[{i}]")
    elif a != b:
        print("DIFF", path, repr(a)[:300], repr(b)[:300])


def test_routing_from_the_upstream_is_stored_and_bad_routing_is_quarantined(fake, start_recorder):
    """vLLM's ``routed_experts`` (base64 .npy) is stored per call as the compact blob; routing that
    does not decode or does not fit the call is stored as received, counted, and quarantined by
    selection (``bad_routing``), never trained on."""
    import base64
    import io

    import numpy as np

    from prodrl_pipelines.trajectories.routing import decode_routing
    from prodrl_pipelines.trajectories.validation import validate_rows

    def npy(a) -> str:
        buf = io.BytesIO()
        np.save(buf, np.asarray(a, dtype=np.int32))
        return base64.b64encode(buf.getvalue()).decode()

    good = np.array([[[0, 1], [2, 3]]] * 5)  # 3 prompt + 3 output ids: 5 forwarded positions, 2 layers, k=2
    r = start_recorder(fake.url, tokenizer_dir=None)
    for value in (npy(good), npy(good[:4]), "%%% not base64", None):
        fake.routing = value
        resp = r.http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3},
                           headers={"X-Trajectory-Id": f"r{value is None}{len(value or '')}"})
        assert resp.status_code == 200 and resp.headers["x-prodrl-recorded"] == "true"
    s = r.stats()
    assert s["routing_recorded"] == 1 and s["routing_malformed"] == 2
    calls = r.store().read_calls()
    by_id = {x["trajectory_id"]: x for x in calls.to_pylist()}
    assert sum(x["routed_experts"] is None for x in by_id.values()) == 1
    assert by_id["rFalse%d" % len("%%% not base64")]["routed_experts"] == b"%%% not base64"  # as received
    assert np.array_equal(decode_routing(by_id["rFalse%d" % len(npy(good))]["routed_experts"]), good)
    assert len(decode_routing(by_id["rFalse%d" % len(npy(good[:4]))]["routed_experts"])) == 4
    rewards = pa.Table.from_pylist([{"trajectory_id": t, "reward": 1.0, "source": "t", "created_at": None}
                                    for t in by_id])
    counts = validate_rows(calls, rewards, 64, {"fake-v3"}, check_top=True, check_prompt=True).result().counts
    assert counts["bad_routing"] == 2 and sum(counts.values()) == 2
