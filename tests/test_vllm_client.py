"""vLLM client: the engine interface over HTTP, checked against `prodrl serve` on loopback."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.logprob_parsing import head_support_complete, parse_chat_logprobs, parse_completion_logprobs, reconstruct_head
from prodrl_pipelines.engines.openai_protocol import (
    LOGPROB_FLOOR,
    ProtocolError,
    token_id_string,
)
from prodrl_pipelines.engines.server import BackgroundServer, build_app
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.engines.vllm_client import VLLMClient, VLLMError, request_seed, vllm_serve_command, vllm_serve_env
from prodrl_pipelines.lab.arithmetic import generate_tasks
from prodrl_pipelines.lab.episodes import run_episodes
from prodrl_pipelines.lab.warmstart import build_base_policy

EOS = 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(engine, model_dir):
    app = build_app(engine, model_dir=model_dir, served_model_name="policy-v0", max_logprobs=20,
                    api_key="k3y", batch_wait_ms=2)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture
def client(server):
    with VLLMClient(server.url, api_key="k3y", timeout=60, max_concurrency=8) as c:
        yield c


class PerPromptLocal:
    """The local engine run the way the client asks the server: each prompt alone, seed request_seed(seed, i)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params, seed=None):
        return [self.engine.generate([p], params, seed=request_seed(seed, i))[0] for i, p in enumerate(prompts)]


def test_vllm_serve_command():
    cmd = vllm_serve_command("/exports/round-000003", 8011, max_logprobs=24, python="/venv/bin/python")
    assert cmd[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/exports/round-000003"]
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags["--port"] == "8011" and flags["--host"] == "127.0.0.1"
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--max-logprobs"] == "24"
    assert flags["--generation-config"] == "vllm" and flags["--served-model-name"] == "round-000003"
    assert "--quantization" not in cmd  # NVFP4 is read from config.json; forced on bf16 it crashes vLLM
    assert vllm_serve_command("/m", 1, python="p", extra_args=["--enforce-eager"])[-1] == "--enforce-eager"
    env = vllm_serve_env("127.0.0.1", base={"PATH": "/bin"})
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["PATH"] == "/bin"
    assert env["PYTHONFAULTHANDLER"] == "1"  # a worker killed by a fatal signal leaves its stack in the log


PROMPTS = [[1, 116, 5, 24, 17, 25, 35, 2, 5, 1, 121, 5], [1, 40, 41, 42], [5, 6, 7, 8, 9, 10, 11]] * 2


@pytest.mark.parametrize(
    "params,complete",
    [
        (SamplingParams(max_tokens=10, num_top_logprobs=8, stop_token_ids=(EOS,)), False),
        (SamplingParams(max_tokens=10, top_k=5, num_top_logprobs=8, stop_token_ids=(EOS,)), True),
        (SamplingParams(max_tokens=10, temperature=0.7, top_p=0.05, num_top_logprobs=8, stop_token_ids=(EOS,)), True),
        (SamplingParams(max_tokens=6, temperature=1.3, top_k=30, top_p=0.9, num_top_logprobs=20), False),
    ],
)
def test_client_records_equal_the_local_engine(client, engine, params, complete):
    got = client.generate(PROMPTS, params, seed=17)
    want = PerPromptLocal(engine).generate(PROMPTS, params, seed=17)
    assert len(got) == len(PROMPTS)
    for g, w in zip(got, want):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.output_token_ids == w.output_token_ids
        assert g.output_logprobs == pytest.approx(w.output_logprobs, abs=1e-5)
        assert g.top_token_ids == w.top_token_ids
        for a, b in zip(g.top_logprobs, w.top_logprobs):
            assert a == pytest.approx(b, abs=1e-5)
        assert g.support_complete == w.support_complete == complete
        assert g.finish_reason == w.finish_reason
        body = w.output_token_ids[:-1] if w.finish_reason == "stop" else w.output_token_ids
        assert g.output_text == engine.tokenizer.decode(body, skip_special_tokens=False)  # vLLM drops the stop token
        assert g.extra["model"] == "policy-v0"
    # the seed makes the batch reproducible; different prompts get different seeds
    assert [r.output_token_ids for r in client.generate(PROMPTS, params, seed=17)] == [r.output_token_ids for r in got]
    assert len({request_seed(17, i) for i in range(len(PROMPTS))}) == len(PROMPTS)


def test_lab_episodes_through_the_client_equal_the_local_engine(client, engine):
    tasks = generate_tasks(6, seed=3)
    params = SamplingParams(max_tokens=8, num_top_logprobs=4)
    via_http = run_episodes(client, engine.tokenizer, tasks, params, policy_version="policy-v0", seed=5)
    local = run_episodes(PerPromptLocal(engine), engine.tokenizer, tasks, params, policy_version="policy-v0", seed=5)
    keys = ("trajectory_id", "call_index", "prompt_token_ids", "output_token_ids", "top_token_ids", "support_complete")
    a, b = via_http.call_rows(), local.call_rows()
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    for ra, rb in zip(a, b):
        assert ra["output_logprobs"] == pytest.approx(rb["output_logprobs"], abs=1e-5)
    assert via_http.rewards == local.rewards


def test_client_errors_are_clear(client, server, engine):
    with pytest.raises(VLLMError, match="greater than max allowed: 20") as e:
        client.generate(PROMPTS[:1], SamplingParams(max_tokens=2, num_top_logprobs=21), seed=0)
    assert e.value.status == 400
    with pytest.raises(ValueError, match="empty"):
        client.generate([[]], SamplingParams(), seed=0)
    assert client.generate([], SamplingParams()) == []
    with VLLMClient(server.url, api_key="wrong") as bad:
        with pytest.raises(VLLMError, match="401") as e:
            bad.generate(PROMPTS[:1], SamplingParams(max_tokens=2), seed=0)
        assert e.value.status == 401
    with VLLMClient("http://127.0.0.1:9", timeout=2) as down:
        assert not down.health()
        with pytest.raises(VLLMError, match="failed"):
            down.generate(PROMPTS[:1], SamplingParams(max_tokens=2), seed=0)


def test_client_extra_draw_equals_the_local_engine(client, engine):
    """``record_extra_draw`` sends prodrl's ``extra_draw`` extension; ``prodrl serve`` answers with the
    local engine's extra draw for the same seed (and the sampled tokens of that seeded stream)."""
    p = SamplingParams(max_tokens=8, top_k=30, num_top_logprobs=8, stop_token_ids=(EOS,), record_extra_draw=True)
    assert client.request_body(PROMPTS[0], p, 3)["extra_draw"] is True
    assert "extra_draw" not in client.request_body(PROMPTS[0], SamplingParams(), 3)
    got = client.generate(PROMPTS[:3], p, seed=21)
    want = PerPromptLocal(engine).generate(PROMPTS[:3], p, seed=21)
    for g, w in zip(got, want):
        assert g.output_token_ids == w.output_token_ids
        assert g.extra_token_ids == w.extra_token_ids and len(g.extra_token_ids) == len(g.output_token_ids)
    assert all(r.extra_token_ids is None for r in client.generate(PROMPTS[:1], SamplingParams(max_tokens=3), seed=1))


def test_client_extra_draw_needs_a_server_with_the_extension():
    """vLLM ignores ``extra_draw``: a record asked with the extra draw but answered without it is an error."""
    choice = {"index": 0, "text": "a", "finish_reason": "length", "token_ids": [5], "prompt_token_ids": [1],
              "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.1], "text_offset": [0],
                           "top_logprobs": [{"token_id:5": -0.1, "token_id:6": -2.5}]}}

    def answer(extra):
        async def completions(request):
            ch = dict(choice) if extra is None else {**choice, "extra_token_ids": extra}
            return JSONResponse({"id": "x", "model": "m", "choices": [ch]})
        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    p = SamplingParams(max_tokens=1, num_top_logprobs=1)
    with BackgroundServer(answer(None)) as srv, VLLMClient(srv.url, model="m") as c:
        assert c.generate([[1]], p, seed=0)[0].extra_token_ids is None
        with pytest.raises(VLLMError, match="extra_draw"):
            c.generate([[1]], SamplingParams(max_tokens=1, num_top_logprobs=1, record_extra_draw=True), seed=0)
    with BackgroundServer(answer([9])) as srv, VLLMClient(srv.url, model="m") as c:
        assert c.generate([[1]], p, seed=0)[0].extra_token_ids == [9]
    with BackgroundServer(answer([9, 9])) as srv, VLLMClient(srv.url, model="m") as c:
        with pytest.raises(VLLMError, match="one id per generated token"):
            c.generate([[1]], p, seed=0)


def test_client_rejects_answers_without_token_ids_or_logprobs():
    def answer(choice):
        async def completions(request):
            body = {"id": "x", "model": "m", "choices": [{"index": 0, "text": "a", "finish_reason": "length",
                                                          **choice}]}
            return JSONResponse(body)
        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    p = SamplingParams(max_tokens=1, num_top_logprobs=2)
    with BackgroundServer(answer({"logprobs": None})) as srv, VLLMClient(srv.url, model="m") as c:
        with pytest.raises(VLLMError, match="token ids"):
            c.generate([[1]], p, seed=0)
    with BackgroundServer(answer({"token_ids": [5], "prompt_token_ids": [1], "logprobs": None})) as srv, \
            VLLMClient(srv.url, model="m") as c:
        with pytest.raises(VLLMError, match="no logprobs"):
            c.generate([[1]], p, seed=0)


def test_reload_through_the_client(engine, model_dir, tmp_path):
    other = build_base_policy(tmp_path / "v1", size="tiny", seed=2, sft_steps=5, progress=False)
    # load_model replaces what every client is served: only a server with an API key has it
    app = build_app(engine, model_dir=model_dir, served_model_name="policy-v0", api_key="admin-key")
    p = SamplingParams(max_tokens=5, num_top_logprobs=3)
    with BackgroundServer(app) as srv, VLLMClient(srv.url, api_key="admin-key") as c:
        before = c.generate(PROMPTS[:2], p, seed=1)
        assert c.reload(other, "policy-v1") == "policy-v1" and c.models() == ["policy-v1"]
        after = c.generate(PROMPTS[:2], p, seed=1)
        assert after[0].extra["model"] == "policy-v1"
        assert [r.output_logprobs for r in after] != [r.output_logprobs for r in before]
        want = PerPromptLocal(LocalEngine.from_pretrained(other)).generate(PROMPTS[:2], p, seed=1)
        assert [r.output_token_ids for r in after] == [r.output_token_ids for r in want]


# ----------------------------------------------------------------------------- head reconstruction


def _dict(entries):
    return {token_id_string(t): lp for t, lp in entries}


def test_reconstruct_head_puts_the_sampled_token_back_at_its_rank():
    top = [(10, -0.5), (11, -1.0), (12, -2.0), (13, -3.0)]
    # sampled token 12 is in the top 4: vLLM lists it first and then the other three
    ids, lps = reconstruct_head(12, -2.0, [(10, -0.5), (11, -1.0), (13, -3.0)], 4, n_requested=4)
    assert ids == [10, 11, 12, 13] and lps == [-0.5, -1.0, -2.0, -3.0]
    # sampled token outside the top 4 (tied with the 4th): the top 4 are kept as they are
    ids, _ = reconstruct_head(99, -3.0, top, 4, n_requested=4)
    assert ids == [10, 11, 12, 13]
    # chat: the list is cut at n entries, sampled first; a top-(n-1) head is exact either way
    assert reconstruct_head(99, -5.0, top[:3], 3)[0] == [10, 11, 12]
    assert reconstruct_head(11, -1.0, [(10, -0.5), (12, -2.0)], 3)[0] == [10, 11, 12]
    with pytest.raises(ProtocolError, match="fewer than"):
        reconstruct_head(11, -1.0, [(10, -0.5)], 3)


def test_parse_completion_and_chat_logprobs():
    lp = {"tokens": [token_id_string(12), token_id_string(7)], "token_logprobs": [-2.0, -0.1],
          "top_logprobs": [_dict([(12, -2.0), (10, -0.5), (11, -1.0)]), _dict([(7, -0.1), (8, -2.5)])]}  # 7 is the top token: 2 entries
    sampled, ids, lps = parse_completion_logprobs(lp, [12, 7], n_requested=2, k=2)
    assert sampled == [-2.0, -0.1] and ids == [[10, 11], [7, 8]] and lps == [[-0.5, -1.0], [-0.1, -2.5]]
    with pytest.raises(ProtocolError, match="positions"):
        parse_completion_logprobs(lp, [12], n_requested=2, k=2)
    with pytest.raises(ProtocolError, match="token_id"):
        parse_completion_logprobs({**lp, "top_logprobs": [{"a": -1.0}, {"b": -1.0}]}, [12, 7], 2, 2)
    chat = {"content": [{"token": token_id_string(5), "logprob": -1.5, "top_logprobs": [
        {"token": token_id_string(5), "logprob": -1.5}, {"token": token_id_string(4), "logprob": -0.3},
        {"token": token_id_string(6), "logprob": -2.0}]}]}
    sampled, ids, lps = parse_chat_logprobs(chat, [5], k=2)
    assert sampled == [-1.5] and ids == [[4, 5]] and lps == [[-0.3, -1.5]]


def test_head_support_complete_rules():
    assert head_support_complete(5, 8, [[-0.1] * 8])  # top_k <= K
    assert not head_support_complete(9, 8, [[-3.0] * 8])
    assert head_support_complete(0, 3, [[-0.1, -2.4, LOGPROB_FLOOR]])  # support smaller than the head
    assert head_support_complete(0, 2, [[-0.6931471805599453, -0.6931471805599453]])  # all the mass
    assert not head_support_complete(0, 2, [[-0.1, -3.0], [-0.1, LOGPROB_FLOOR]])
