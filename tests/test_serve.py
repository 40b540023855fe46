"""`prodrl serve`: vLLM's OpenAI-compatible API over the local engine (loopback, in-process server)."""

from __future__ import annotations

import json
from collections import Counter
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from prodrl_pipelines.engines.logprob_parsing import parse_token_id
from prodrl_pipelines.engines.openai_protocol import LOGPROB_FLOOR, iter_sse_data
from prodrl_pipelines.engines.server import BackgroundServer, build_app
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.lab.episodes import render_prompt
from prodrl_pipelines.lab.warmstart import build_base_policy
from tests.helpers import until

EOS = 2  # the lab tokenizer's <|im_end|>
PROMPT = [1, 116, 5, 24, 17, 25, 35, 2, 5, 1, 121, 5]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(engine, model_dir):
    app = build_app(engine, model_dir=model_dir, served_model_name="v0", max_logprobs=20, batch_wait_ms=2)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def local(engine, prompt, seed, **kw):
    kw.setdefault("stop_token_ids", (EOS,))
    return engine.generate([prompt], SamplingParams(**kw), seed=seed)[0]


def test_models_and_health(http, model_dir):
    assert http.get("/health").status_code == 200
    data = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["v0"]
    assert data[0]["root"] == str(model_dir) and data[0]["max_model_len"] == 256


def test_completion_ids_and_processed_logprobs_equal_the_local_engine(http, engine):
    body = {"prompt": PROMPT, "max_tokens": 10, "logprobs": 5, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "seed": 11}
    out = http.post("/v1/completions", json=body).json()
    ch = out["choices"][0]
    rec = local(engine, PROMPT, 11, max_tokens=10, num_top_logprobs=5)
    assert ch["prompt_token_ids"] == PROMPT
    assert ch["token_ids"] == rec.output_token_ids
    lp = ch["logprobs"]
    assert [parse_token_id(t) for t in lp["tokens"]] == rec.output_token_ids
    assert lp["token_logprobs"] == pytest.approx(rec.output_logprobs, abs=1e-6)
    for t, top, lp_t, hid, hlp in zip(rec.output_token_ids, lp["top_logprobs"], rec.output_logprobs,
                                      rec.top_token_ids, rec.top_logprobs):
        entries = [(parse_token_id(k), v) for k, v in top.items()]
        # vLLM's order: the sampled token first, then the top 5 (the sampled one not repeated)
        expected = [(t, lp_t)] + [(i, v) for i, v in zip(hid, hlp) if i != t]
        assert [e[0] for e in entries] == [e[0] for e in expected][: len(entries)]
        assert len(entries) == (5 if t in hid else 6)
        assert [e[1] for e in entries] == pytest.approx([e[1] for e in expected][: len(entries)], abs=1e-6)
    assert lp["text_offset"][0] == 0
    assert ch["finish_reason"] == rec.finish_reason
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(PROMPT) and usage["completion_tokens"] == len(rec.output_token_ids)


def test_completion_token_strings_text_and_offsets(http, engine):
    out = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "logprobs": 2, "seed": 3}).json()
    ch = out["choices"][0]
    assert ch["token_ids"] is None and ch["prompt_token_ids"] is None  # not asked for
    rec = local(engine, PROMPT, 3, max_tokens=8, num_top_logprobs=2)
    tok = engine.tokenizer
    lp = ch["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in rec.output_token_ids]
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    ids = rec.output_token_ids[:-1] if rec.finish_reason == "stop" else rec.output_token_ids
    assert ch["text"] == tok.decode(ids, skip_special_tokens=True)


def test_text_prompt_is_tokenized_like_token_ids(http, engine):
    text = engine.tokenizer.decode(PROMPT[:1] + [40, 41, 42])
    a = http.post("/v1/completions", json={"prompt": text, "max_tokens": 6, "seed": 5,
                                           "return_token_ids": True}).json()["choices"][0]
    ids = list(engine.tokenizer(text, add_special_tokens=True)["input_ids"])
    b = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "seed": 5,
                                           "return_token_ids": True}).json()["choices"][0]
    assert a["prompt_token_ids"] == ids and a["token_ids"] == b["token_ids"]


def test_processed_logprobs_floor_outside_the_top_k_support(http):
    out = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "top_k": 3, "logprobs": 5,
                                             "return_tokens_as_token_ids": True, "seed": 2}).json()
    for top in out["choices"][0]["logprobs"]["top_logprobs"]:
        vals = sorted(top.values(), reverse=True)
        assert vals[3:] == [LOGPROB_FLOOR] * (len(vals) - 3)  # outside the support: -inf, floored
        assert sum(math.exp(v) for v in vals[:3]) == pytest.approx(1.0, abs=1e-5)  # renormalised over the top 3


def test_chat_renders_the_template_and_formats_chat_logprobs(http, engine):
    messages = [{"role": "user", "content": "12+7="}]
    out = http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 8, "logprobs": True, "top_logprobs": 3, "return_token_ids": True,
        "seed": 9, "return_prompt_text": True}).json()
    text, ids = render_prompt(engine.tokenizer, messages)
    assert out["prompt_token_ids"] == ids and out["prompt_text"] == text
    ch = out["choices"][0]
    rec = local(engine, ids, 9, max_tokens=8, num_top_logprobs=3)
    assert ch["token_ids"] == rec.output_token_ids
    content = ch["logprobs"]["content"]
    tok = engine.tokenizer
    for t, lp_t, item, hid in zip(rec.output_token_ids, rec.output_logprobs, content, rec.top_token_ids):
        assert item["token"] == tok.decode([t]) and item["logprob"] == pytest.approx(lp_t, abs=1e-6)
        assert item["bytes"] == list(item["token"].encode())
        top = item["top_logprobs"]
        assert len(top) == 3  # vLLM: the first n entries of {sampled, top-1, ...}
        assert top[0]["token"] == item["token"]
        assert [e["token"] for e in top[1:]] == [tok.decode([i]) for i in hid if i != t][:2]
    body = [t for t in rec.output_token_ids if t != EOS]
    assert ch["message"]["role"] == "assistant"
    assert ch["message"]["content"] == tok.decode(body, skip_special_tokens=True)


def _stream(http, path, body):
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = list(iter_sse_data(r.iter_lines()))
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_stream_matches_the_non_streamed_answer(http):
    body = {"prompt": PROMPT, "max_tokens": 9, "logprobs": 2, "return_token_ids": True, "seed": 21,
            "stream_options": {"include_usage": True}}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    chunks = _stream(http, "/v1/completions", body)
    usage = chunks.pop()["usage"]
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"] == PROMPT and all(c["prompt_token_ids"] is None for c in choices[1:])
    assert sum((c["token_ids"] for c in choices), []) == full["token_ids"]
    assert "".join(c["text"] for c in choices) == full["text"]
    assert sum((c["logprobs"]["tokens"] for c in choices), []) == full["logprobs"]["tokens"]
    assert sum((c["logprobs"]["text_offset"] for c in choices), []) == full["logprobs"]["text_offset"]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [full["finish_reason"]]
    assert usage["completion_tokens"] == len(full["token_ids"])


def test_chat_stream_matches_the_non_streamed_answer(http):
    body = {"messages": [{"role": "user", "content": "3+4="}], "max_tokens": 7, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True, "seed": 4}
    full = http.post("/v1/chat/completions", json=body).json()
    chunks = _stream(http, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    rest = [c["choices"][0] for c in chunks[1:]]
    ch = full["choices"][0]
    assert sum((c["token_ids"] for c in rest), []) == ch["token_ids"]
    assert "".join(c["delta"]["content"] for c in rest) == ch["message"]["content"]
    assert sum((c["logprobs"]["content"] for c in rest), []) == ch["logprobs"]["content"]
    assert rest[-1]["finish_reason"] == ch["finish_reason"]


def test_extra_draw_extension_returns_the_local_engines_extra_draw(http, engine):
    """``"extra_draw": true`` (prodrl extension) adds per-choice ``extra_token_ids``: the local engine's
    ``record_extra_draw`` for the same seed; absent when not asked; streamed as per-chunk deltas."""
    body = {"prompt": PROMPT, "max_tokens": 10, "seed": 31, "return_token_ids": True, "top_k": 40, "extra_draw": True}
    ch = http.post("/v1/completions", json=body).json()["choices"][0]
    rec = local(engine, PROMPT, 31, max_tokens=10, top_k=40, record_extra_draw=True)
    assert ch["token_ids"] == rec.output_token_ids and ch["extra_token_ids"] == rec.extra_token_ids
    assert len(ch["extra_token_ids"]) == len(ch["token_ids"])
    assert ch["extra_token_ids"] != ch["token_ids"]  # independent draws (40 candidates, 10 positions)
    plain = http.post("/v1/completions", json={**body, "extra_draw": False}).json()["choices"][0]
    assert "extra_token_ids" not in plain
    assert plain["token_ids"] == local(engine, PROMPT, 31, max_tokens=10, top_k=40).output_token_ids
    chunks = [c["choices"][0] for c in _stream(http, "/v1/completions", body)]
    assert sum((c["extra_token_ids"] for c in chunks), []) == rec.extra_token_ids
    assert all(len(c["extra_token_ids"]) == len(c["token_ids"]) for c in chunks)

    messages = [{"role": "user", "content": "2+5="}]
    chat = {"messages": messages, "max_tokens": 6, "seed": 3, "extra_draw": True}
    _, ids = render_prompt(engine.tokenizer, messages)
    want = local(engine, ids, 3, max_tokens=6, record_extra_draw=True)
    assert http.post("/v1/chat/completions", json=chat).json()["choices"][0]["extra_token_ids"] == want.extra_token_ids
    rest = [c["choices"][0] for c in _stream(http, "/v1/chat/completions", chat)[1:]]
    assert sum((c["extra_token_ids"] for c in rest), []) == want.extra_token_ids

    # a stop string cuts the extra draw with the sampled tokens; n > 1 gives each choice its own
    full = http.post("/v1/completions", json={**body, "ignore_eos": True, "max_tokens": 12}).json()["choices"][0]
    stop = full["text"][3:5]
    cut = http.post("/v1/completions", json={**body, "ignore_eos": True, "max_tokens": 12,
                                             "stop": [stop]}).json()["choices"][0]
    assert cut["extra_token_ids"] == full["extra_token_ids"][: len(cut["token_ids"])]
    two = http.post("/v1/completions", json={**body, "n": 2}).json()["choices"]
    assert all(len(c["extra_token_ids"]) == len(c["token_ids"]) for c in two)


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, 400, "greater than max allowed: 20"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "logprobs": True,
                                  "top_logprobs": 21}, 400, "greater than max allowed: 20"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "top_logprobs": 2}, 400,
         "`logprobs` must be set to true"),
        ("/v1/completions", {"prompt": PROMPT, "model": "nope"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": [1, 5, 999]}, 400, "out of vocabulary"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 300}, 400, "maximum context length is 256"),
        ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 0.5}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ],
)
def test_bad_requests_are_answered_like_vllm(http, path, body, status, needle):
    r = http.post(path, json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status


def test_malformed_json_is_a_400(http):
    for raw in (b"{not json", b"[1, 2]"):
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    # the server keeps serving
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_stop_strings_n_and_greedy(http, engine):
    base = {"prompt": PROMPT, "max_tokens": 12, "seed": 8, "return_token_ids": True, "ignore_eos": True}
    full = http.post("/v1/completions", json=base).json()["choices"][0]
    stop = full["text"][3:5]
    cut = http.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == full["text"][: full["text"].find(stop)]
    assert full["token_ids"][: len(cut["token_ids"])] == cut["token_ids"]
    two = http.post("/v1/completions", json={**base, "n": 2}).json()["choices"]
    assert [c["index"] for c in two] == [0, 1] and two[0]["token_ids"] != two[1]["token_ids"]
    g = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1,
                                           "return_token_ids": True}).json()["choices"][0]
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    assert g["token_ids"][0] == int(logits.argmax()) and g["logprobs"]["token_logprobs"][0] == 0.0


def test_concurrent_unseeded_requests_share_engine_calls(engine, model_dir):
    """The batching loop: requests waiting while the engine is busy go into one generate call."""
    calls: list[int] = []
    release = threading.Event()

    class Gated:
        tokenizer = engine.tokenizer
        vocab_size = engine.vocab_size
        model = engine.model

        def generate(self, prompts, params, seed=None):
            calls.append(len(prompts))
            if len(calls) == 1:
                release.wait(180)  # hold the engine until every other request is queued (a ceiling)
            return engine.generate(prompts, params, seed=seed)

    app = build_app(Gated(), model_dir=model_dir, served_model_name="v0", batch_wait_ms=0)
    batcher = app.state.serve.batcher
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c, ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(c.post, "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}) for _ in range(8)]
        deadline = time.monotonic() + 180
        while batcher.stats.requests < 8 and time.monotonic() < deadline:  # all 8 reached the batcher
            time.sleep(0.01)
        release.set()
        assert all(f.result().status_code == 200 for f in futs)
    assert len(calls) == 2 and sum(calls) == 8  # the first call, then everything that queued behind it
    assert batcher.stats.requests == 8 and batcher.stats.generate_calls == 2


def test_seeded_requests_do_not_depend_on_concurrent_traffic(http, server):
    body = {"prompt": PROMPT, "max_tokens": 8, "seed": 1234, "return_token_ids": True}
    alone = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    with ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(http.post, "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8})
                 for _ in range(5)]
        again = pool.submit(http.post, "/v1/completions", json=body)
        assert all(f.result().status_code == 200 for f in noise)
        assert again.result().json()["choices"][0]["token_ids"] == alone


def test_load_model_redeploys_and_api_key_guards_v1(engine, model_dir, tmp_path):
    other = build_base_policy(tmp_path / "other", size="tiny", seed=1, sft_steps=5, progress=False)
    app = build_app(engine, model_dir=model_dir, served_model_name="v0", api_key="sekret")
    body = {"prompt": PROMPT, "max_tokens": 6, "seed": 3, "logprobs": 1}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.post("/v1/completions", json=body).status_code == 401
        assert c.get("/health").status_code == 200  # as vLLM: only /v1 is guarded
        auth = {"Authorization": "Bearer sekret"}
        before = c.post("/v1/completions", json=body, headers=auth).json()["choices"][0]["logprobs"]
        bad = c.post("/v1/load_model", json={"model_dir": str(tmp_path / "missing")}, headers=auth)
        assert bad.status_code == 400 and "cannot load" in bad.json()["error"]["message"]
        r = c.post("/v1/load_model", json={"model_dir": str(other), "served_model_name": "v1"}, headers=auth)
        assert r.status_code == 200 and r.json()["model"] == "v1"
        assert [m["id"] for m in c.get("/v1/models", headers=auth).json()["data"]] == ["v1"]
        after = c.post("/v1/completions", json={**body, "model": "v1"}, headers=auth).json()["choices"][0]["logprobs"]
        assert after["token_logprobs"] != before["token_logprobs"]
        assert c.post("/v1/completions", json={**body, "model": "v0"}, headers=auth).status_code == 404


class GatedEngine:
    """The real engine, whose generation waits until the test opens the gate: the engine thread is
    busy for as long as the test needs (what a long batch does)."""

    def __init__(self, engine) -> None:
        self.inner, self.gate, self.entered = engine, threading.Event(), threading.Event()
        self.model, self.tokenizer, self.vocab_size = engine.model, engine.tokenizer, engine.vocab_size

    def generate(self, prompts, params, seed=None):
        self.entered.set()
        assert self.gate.wait(300)
        return self.inner.generate(prompts, params, seed=seed)


def test_probes_are_open_and_readiness_says_a_model_is_loading(engine, model_dir):
    """``/health/live`` and ``/health/ready`` need no key (the API does); while ``/v1/load_model``
    waits for the engine thread (busy with a generation) readiness is 503 naming the directory, and
    200 again once the load is done."""
    gated = GatedEngine(engine)
    app = build_app(gated, model_dir=model_dir, served_model_name="v0", api_key="k", batch_wait_ms=0)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as h, ThreadPoolExecutor(2) as pool:
        assert h.get("/v1/models").status_code == 401 and h.get("/health/live").json() == {"live": True}
        ready = h.get("/health/ready")
        assert ready.status_code == 200 and ready.json()["checks"]["model"] == {"ok": True, "served": "v0"}
        key = {"Authorization": "Bearer k"}
        busy = pool.submit(h.post, "/v1/completions", json={"model": "v0", "prompt": PROMPT, "max_tokens": 2}, headers=key)
        assert gated.entered.wait(120)  # the engine thread is in the generation
        load = pool.submit(h.post, "/v1/load_model", json={"model_dir": str(model_dir), "served_model_name": "v1"},
                           headers=key)
        r = until("the load reaches the server", lambda: (x := h.get("/health/ready")).status_code != 200 and x,
                  120, every_s=0.05)
        assert r.status_code == 503 and r.json()["checks"]["model"]["reason"] == f"loading {model_dir}"
        assert r.json()["checks"]["batching"] == {"ok": True}
        gated.gate.set()
        assert busy.result().status_code == 200 and load.result().json()["model"] == "v1"
        ready = h.get("/health/ready")
        assert ready.status_code == 200 and ready.json()["checks"]["model"]["served"] == "v1"


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def test_metrics_carry_vllms_names_and_count_what_was_served(engine, model_dir):
    """``/metrics`` is open (the key guards /v1); while the engine thread holds one request the
    gauges say 1 running and 2 waiting; afterwards vLLM's counters and histograms hold the three
    requests' tokens and latencies, and a refused request is in none of them."""
    gated = GatedEngine(engine)
    app = build_app(gated, model_dir=model_dir, served_model_name="v0", api_key="k", batch_wait_ms=0)
    key = {"Authorization": "Bearer k"}
    body = {"model": "v0", "prompt": PROMPT, "max_tokens": 3}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as h, ThreadPoolExecutor(3) as pool:
        first = pool.submit(h.post, "/v1/completions", json=body, headers=key)
        assert gated.entered.wait(120)
        rest = [pool.submit(h.post, "/v1/completions", json=body, headers=key) for _ in range(2)]
        running = ("vllm:num_requests_running", (("model_name", "v0"),))
        waiting = ("vllm:num_requests_waiting", (("model_name", "v0"),))
        m = until("two requests queue behind the busy engine",
                  lambda: (x := _samples(h.get("/metrics").text))[waiting] == 2 and x, 120, every_s=0.05)
        assert m[running] == 1
        gated.gate.set()
        answers = [f.result().json() for f in (first, *rest)]
        assert h.post("/v1/completions", json={**body, "max_tokens": -1}, headers=key).status_code == 400
        m = _samples(h.get("/metrics").text)
    v0 = (("model_name", "v0"),)
    assert m[running] == 0 and m[waiting] == 0
    assert m[("vllm:prompt_tokens_total", v0)] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert m[("vllm:generation_tokens_total", v0)] == sum(a["usage"]["completion_tokens"] for a in answers)
    reasons = Counter(a["choices"][0]["finish_reason"] for a in answers)
    assert {r: m[("vllm:request_success_total", (("finished_reason", r), ("model_name", "v0")))] for r in reasons} == reasons
    for h_ in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
               "vllm:request_inference_time_seconds"):
        assert m[(h_ + "_count", v0)] == 3, h_
    assert m[("vllm:e2e_request_latency_seconds_sum", v0)] >= m[("vllm:time_to_first_token_seconds_sum", v0)]
