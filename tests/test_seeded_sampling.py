"""A seeded request samples the same tokens whatever logprobs it asks for (as in vLLM).

The recorder always asks its upstream for 20 logprobs (chat: ``top_logprobs`` 21); a user's direct
call with the same seed usually asks for none. vLLM's sampler does not depend on that count (the
logprobs are gathered after sampling), so neither may the local engine's: it used to draw from the
recorded head (``torch.multinomial`` over the K most likely tokens) whenever that head held the
whole support, and from the full row's CDF otherwise, so with top-k <= K (or a top-p support <= K)
asking for K logprobs changed every sampled token.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from prodrl_pipelines.engines.local import _sample
from prodrl_pipelines.engines.sampling import processed_logprobs, top_logprobs
from prodrl_pipelines.engines.server import BackgroundServer, build_app
from prodrl_pipelines.engines.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = 1234
MAX_TOKENS = 32


def _draw(proc: torch.Tensor, k: int, seed: int) -> tuple[torch.Tensor, bool]:
    ids, lps, complete = top_logprobs(proc, k)
    return _sample(proc, ids, lps, complete, torch.Generator().manual_seed(seed)), bool(complete.all())


@pytest.mark.parametrize("filters", [dict(top_k=5), dict(top_p=0.6), dict(top_k=12, top_p=0.9)],
                         ids=["top_k5", "top_p0.6", "top_k12_top_p0.9"])
def test_the_draw_does_not_depend_on_the_head_size(filters):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(512, 300, generator=gen) * 3.0  # peaked enough that top-p keeps a few tokens
    proc = processed_logprobs(logits, **filters)
    for seed in range(4):
        ref, ref_complete = _draw(proc, 1, seed)
        assert not ref_complete  # K = 1: the whole-row CDF
        for k in (8, 20, 64):
            got, complete = _draw(proc, k, seed)
            assert complete or k < 20  # the larger heads hold every row's support: the head path
            assert torch.equal(got, ref), (filters, seed, k, int((got != ref).sum()))


def test_the_draw_does_not_depend_on_the_head_size_when_the_vocabulary_is_smaller():
    logits = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    proc = processed_logprobs(logits, top_p=0.95)
    ref, _ = _draw(proc, 1, 7)
    got, complete = _draw(proc, 10, 7)  # K > vocabulary: the head is padded with prob-0 entries
    assert complete and torch.equal(got, ref)


@pytest.mark.parametrize("filters", [dict(top_k=20), dict(top_k=20, top_p=0.9), dict(top_p=0.9), {}],
                         ids=["top_k20", "top_k20_top_p0.9", "top_p0.9", "none"])
def test_seeded_generate_same_tokens_for_any_number_of_logprobs(engine, filters):
    prompts = [[1, 116, 5, 24, 17 + i, 25, 35, 2, 5, 1, 121, 5] for i in range(6)]
    for i, p in enumerate(prompts):
        recs = {k: engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS, num_top_logprobs=k, **filters),
                                   seed=SEED + i)[0] for k in (1, 5, 20)}
        for k in (5, 20):
            assert recs[k].output_token_ids == recs[1].output_token_ids, (filters, i, k)
            assert recs[k].output_logprobs == recs[1].output_logprobs


@pytest.fixture(scope="module")
def http(engine, model_dir):
    app = build_app(engine, model_dir=model_dir, served_model_name="v0", max_logprobs=21, batch_wait_ms=2)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def test_serve_seeded_tokens_do_not_depend_on_the_logprobs_asked(http):
    """What the recorder asks (20 logprobs, token-id strings, explicit defaults) against a plain
    seeded call, on both routes, with top-k 20 (the head of 20 then holds the whole support)."""
    user = {"seed": SEED, "temperature": 1.0, "top_k": 20, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "return_token_ids": True}
    recorder = {"return_tokens_as_token_ids": True, "top_p": 1.0}
    for i, text in enumerate(["What is 3 + 4 ?", "Compute 17 + 25 ?", "Add 8 + 91 ?"]):
        comp = {**user, "prompt": text, "seed": SEED + i}
        a = http.post("/v1/completions", json=comp).json()["choices"][0]["token_ids"]
        for extra in ({"logprobs": 1}, {"logprobs": 20, **recorder}):
            b = http.post("/v1/completions", json={**comp, **extra}).json()["choices"][0]["token_ids"]
            assert b == a, (text, extra)
        chat = {**user, "messages": [{"role": "user", "content": text}], "seed": SEED + i}
        a = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["token_ids"]
        for extra in ({"logprobs": True, "top_logprobs": 5}, {"logprobs": True, "top_logprobs": 21, **recorder}):
            b = http.post("/v1/chat/completions", json={**chat, **extra}).json()["choices"][0]["token_ids"]
            assert b == a, (text, extra)
