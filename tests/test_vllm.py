"""Against a real vLLM (CPU build): the client, the recorder in front of it, and the in-place reload
target, on one server per session (``vllm_server``). The restart target and every export scheme
are in ``test_vllm_restart.py`` (they start servers of their own, so the two files run in parallel)."""

from __future__ import annotations

import json
import math

import pytest

from prodrl_pipelines.deploy_targets import endpoint_file
from prodrl_pipelines.deploy_targets.base import DeployError
from prodrl_pipelines.deploy_targets.reload import VLLMReloadTarget
from prodrl_pipelines.deploy_targets.rollout import roll_out
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.engines.vllm_client import VLLMClient
from prodrl_pipelines.config.settings import Settings
from tests.vllm_support import PROMPTS, logprob_mismatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIGURES: dict[str, dict] = {}  # |log mu_vllm - log mu_local| and probe figures, printed at the end


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    print("\n|log mu_vllm - log mu_local| (vLLM vs the local engine):", json.dumps(FIGURES, indent=1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=8, num_top_logprobs=8),
    SamplingParams(temperature=0.8, top_k=5, max_tokens=8, num_top_logprobs=8),
    SamplingParams(temperature=1.2, top_p=0.7, max_tokens=8, num_top_logprobs=8),
], ids=["plain", "top_k", "top_p"])
def test_client_against_vllm(vllm_server, vllm_exports, params):
    with VLLMClient(vllm_server.url) as client:
        assert client.model == "dense-bf16"
        recs = client.generate(PROMPTS, params, seed=7)
        again = client.generate(PROMPTS, params, seed=7)
    for p, r, r2 in zip(PROMPTS, recs, again):
        assert r.prompt_token_ids == p  # token-id prompts are consumed as given
        assert 1 <= len(r.output_token_ids) <= params.max_tokens and r.output_token_ids == r2.output_token_ids
        assert all(math.isfinite(x) and x <= 0 for x in r.output_logprobs)
        for pos, (ids, lps) in enumerate(zip(r.top_token_ids, r.top_logprobs)):
            assert len(ids) == params.num_top_logprobs
            if r.output_token_ids[pos] not in ids:  # then it is less likely than every head entry
                assert r.output_logprobs[pos] <= min(lps) + 1e-6
        if params.top_k:
            # the K-head holds the whole support (top_k <= K): processed logprobs sum to 1 over it
            assert r.support_complete
            for lps in r.top_logprobs:
                finite = [x for x in lps if x > -9999.0]  # vLLM floors filtered tokens at -9999
                assert len(finite) >= min(params.top_k, len(lps))  # ties at the k-th value are kept
                assert abs(math.log(sum(math.exp(x) for x in finite))) < 2e-3
    m = logprob_mismatch(recs, vllm_exports["dense-bf16"], params)
    FIGURES[f"bf16 dense ({params.top_k=}, {params.top_p=})"] = m
    assert m["mean"] < 2e-2 and m["max"] < 0.3, m  # vLLM computes in bf16, the local engine in fp32


def test_recorder_in_front_of_vllm(vllm_server, tmp_path):
    from openai import OpenAI

    from prodrl_pipelines.engines.server import BackgroundServer
    from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app

    app = build_recorder_app(RecorderConfig(upstream=vllm_server.url, store_dir=str(tmp_path / "store"),
                                            token="t", top_logprobs=5))
    with BackgroundServer(app) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="t", max_retries=0)
        answers = {}
        c = client.completions.create(model="dense-bf16", prompt="12+3=", max_tokens=6,
                                      logprobs=3, seed=1, extra_headers={"X-Trajectory-Id": "t-comp"})
        answers["t-comp"] = c.choices[0].text
        stream = client.completions.create(model="dense-bf16", prompt="7+8=", max_tokens=6, stream=True, seed=2,
                                           extra_headers={"X-Trajectory-Id": "t-stream"})
        answers["t-stream"] = "".join(ch.choices[0].text for ch in stream if ch.choices)
        chat = client.chat.completions.create(model="dense-bf16", messages=[{"role": "user", "content": "1+1="}],
                                              max_tokens=6, logprobs=True, top_logprobs=2, seed=3,
                                              extra_headers={"X-Trajectory-Id": "t-chat"})
        answers["t-chat"] = chat.choices[0].message.content or ""
        resp = client.responses.create(model="dense-bf16", input="2+2=", max_output_tokens=6,
                                       extra_body={"seed": 4}, extra_headers={"X-Trajectory-Id": "t-resp"})
        answers["t-resp"] = resp.output_text
        events = list(client.responses.create(model="dense-bf16", input="5+2=", max_output_tokens=6, stream=True,
                                              extra_body={"seed": 5}, extra_headers={"X-Trajectory-Id": "t-resp-s"}))
        assert events[-1].type in ("response.completed", "response.incomplete")
        answers["t-resp-s"] = events[-1].response.output_text
        rec = app.state.recorder
        assert rec.ingestor.flush(30)
        rows = {r["trajectory_id"]: r for r in rec.store.read_calls().to_pylist()}
    assert set(rows) == {"t-comp", "t-stream", "t-chat", "t-resp", "t-resp-s"}
    # every recorded call is what vLLM returned: re-score its tokens through vLLM itself
    with VLLMClient(vllm_server.url) as vc:
        for tid, row in rows.items():
            assert row["policy_version"] == "dense-bf16"  # the served name, not the client's
            assert row["output_text"] == answers[tid]
            assert len(row["top_token_ids"]) == len(row["output_token_ids"]) and len(row["top_token_ids"][0]) == 5
            p = SamplingParams(temperature=row["temperature"], top_p=row["top_p"], top_k=row["top_k"],
                               max_tokens=1, num_top_logprobs=5)
            # the first sampled token's logprob as vLLM reports it for this prompt (prompt_token_ids)
            body = vc.request_body(row["prompt_token_ids"], p, None)
            first = vc._request("POST", "/v1/completions", json=body).json()["choices"][0]
            head = {int(k.split(":")[1]): v for k, v in first["logprobs"]["top_logprobs"][0].items()}
            if row["output_token_ids"][0] in head:
                assert abs(head[row["output_token_ids"][0]] - row["output_logprobs"][0]) < 1e-4


def test_reload_refuses_a_moe_export_on_an_external_cpu_server(vllm_server, vllm_exports, tmp_path):
    settings = Settings(home=str(tmp_path / "home"), deploy={"target": "vllm-reload", "target_endpoint": vllm_server.url})
    with pytest.raises(DeployError, match="MoE.*vllm-restart"):
        VLLMReloadTarget(settings, settings.home_path).switch(vllm_exports["moe-bf16"], "moe")


def test_reload_in_place_is_probed_and_rolled_back(vllm_server, vllm_exports, tmp_path):
    """vllm-reload on the session's (dev-mode) server: the same weights under a new version reload
    in place and pass; other weights leave vLLM's CPU backend serving a mix of both (its prepacked
    GEMM weights are not refreshed), which the probe catches and rolls back."""
    settings = Settings(home=str(tmp_path / "home"), deploy={
        "target": "vllm-reload", "target_endpoint": vllm_server.url, "num_top_logprobs": 8, "max_tokens": 8,
        "probe_prompts": 4, "export_scheme": "bf16"})
    target = VLLMReloadTarget(settings, settings.home_path)
    ro = roll_out(settings, target, vllm_exports["dense-bf16"], "v-a", PROMPTS)
    # in place (the mode says so); the bound is only a ceiling for a loaded machine
    assert ro.switch.detail["mode"] == "reload" and ro.probe.passed and ro.switch.detail["reload_seconds"] < 120
    ep = endpoint_file(settings.home_path).read()
    assert (ep.policy_version, ep.served_model_name) == ("v-a", "dense-bf16")  # the name stays, the version moves
    try:
        ro2 = roll_out(settings, target, vllm_exports["dense2-bf16"], "v-b", PROMPTS)
    except DeployError as e:
        assert "parity probe failed" in str(e) and "reloaded v-a in place" in str(e)
        FIGURES["reload other weights (CPU)"] = {"probe_mean": e.probe.mean_abs}
    else:  # a vLLM whose CPU reload refreshes every weight: then the probe passes on the new weights
        assert ro2.probe.passed
    assert endpoint_file(settings.home_path).read().policy_version in ("v-a", "v-b")
