"""Local engine: processed logprobs (vLLM semantics), batched KV-cache sampling, recorded fields."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from prodrl_pipelines.engines.local import TOP_LOGPROB_FLOOR, LocalEngine
from prodrl_pipelines.engines.sampling import processed_logprobs, support_size, top_logprobs
from prodrl_pipelines.engines.types import SamplingParams

VOCAB = 100
PAD, EOS = 0, 1
STOP = (1, 7, 13, 21, 34, 55, 60, 71, 88, 95)  # enough stop ids that some rows stop early


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Wider init than the default 0.02 so the next-token distributions are peaked and
    # top-p actually filters.
    initializer_range=0.2,
    tie_word_embeddings=False,
    pad_token_id=PAD,
    eos_token_id=EOS,
)


# Tiny models: on a shared 2-core machine, 2 OpenMP threads were measured ~20x slower than one.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    torch.manual_seed(0)
    cfg = Qwen3Config(intermediate_size=128, head_dim=16, **_SMALL)
    return LocalEngine(Qwen3ForCausalLM(cfg), _tokenizer())


@pytest.fixture(scope="module")
def moe_engine() -> LocalEngine:
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **_SMALL
    )
    return LocalEngine(Qwen3MoeForCausalLM(cfg), _tokenizer())


def _prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 13, (n,), generator=g).tolist()
    lens[0] = 1  # a one-token prompt next to longer ones exercises left padding hard
    return [torch.randint(2, VOCAB, (L,), generator=g).tolist() for L in lens]


def _full_processed(engine: LocalEngine, rec, params: SamplingParams) -> torch.Tensor:
    """Processed rows [T, V] for the generated positions of one record, from one full forward."""
    ids = torch.tensor([rec.prompt_token_ids + rec.output_token_ids])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0, len(rec.prompt_token_ids) - 1 : -1]
    return processed_logprobs(logits, params.temperature, params.top_k, params.top_p)


PARAMS = [
    SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=STOP),
    SamplingParams(temperature=0.7, top_k=5, max_tokens=16, stop_token_ids=STOP),
    SamplingParams(top_p=0.9, max_tokens=16, stop_token_ids=STOP),
]


# ---------------------------------------------------------------------------- processed_logprobs


def _log_renorm(logits: list[float], kept: list[int], temp: float = 1.0) -> list[float]:
    z = math.log(sum(math.exp(logits[i] / temp) for i in kept))
    return [logits[i] / temp - z if i in kept else -math.inf for i in range(len(logits))]


def test_processed_logprobs_hand_example():
    # Unsorted on purpose; descending order of ids is 3, 0, 4, 1, 2.
    raw = [1.0, 0.0, -1.0, 2.0, 0.5]
    x = torch.tensor(raw, dtype=torch.float64)
    # probs in descending order: .563 .207 .126 .076 .028 (cum .563 .770 .896 .972 1)
    cases = [
        (dict(), [0, 1, 2, 3, 4], 1.0),
        (dict(top_k=3), [3, 0, 4], 1.0),
        (dict(top_p=0.7), [3, 0], 1.0),  # .563 < .7, so the 2nd is needed; .770 >= .7 stops
        (dict(top_p=0.8), [3, 0, 4], 1.0),
        (dict(top_p=0.5), [3], 1.0),  # the most likely token alone already reaches top_p
        (dict(top_p=0.01), [3], 1.0),
        # top-k first, then top-p on the renormalised head: .629 .231 .140 -> keep two
        (dict(top_k=3, top_p=0.8), [3, 0], 1.0),
        (dict(temperature=0.5, top_k=2), [3, 0], 0.5),
        (dict(top_k=VOCAB), [0, 1, 2, 3, 4], 1.0),  # k >= vocab is off
    ]
    for kwargs, kept, temp in cases:
        got = processed_logprobs(x, **kwargs)
        want = torch.tensor(_log_renorm(raw, kept, temp), dtype=torch.float64)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), kwargs
        fin = torch.isfinite(want)
        assert torch.allclose(got[fin], want[fin], atol=1e-12), kwargs
        assert got.exp().sum().item() == pytest.approx(1.0, abs=1e-12)
        assert int(support_size(got)) == len(kept)


def test_processed_logprobs_per_row_params_match_scalar_calls():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 50, generator=g) * 3
    temp = torch.tensor([[1.0, 0.7, 1.3]] * 4)
    top_k = torch.tensor([[0, 5, 10], [3, 0, 0], [1, 50, 7], [0, 0, 2]])
    top_p = torch.tensor([[1.0, 0.9, 0.5], [0.95, 1.0, 0.3], [1.0, 1.0, 0.8], [0.6, 0.99, 1.0]])
    batched = processed_logprobs(logits, temp, top_k, top_p)
    assert batched.shape == logits.shape
    assert batched.dtype == torch.float32
    for i in range(4):
        for j in range(3):
            row = processed_logprobs(logits[i, j], float(temp[i, j]), int(top_k[i, j]), float(top_p[i, j]))
            assert torch.equal(torch.isfinite(row), torch.isfinite(batched[i, j]))
            fin = torch.isfinite(row)
            assert torch.allclose(row[fin], batched[i, j][fin], atol=1e-6)
    assert torch.allclose(batched.exp().sum(-1), torch.ones(4, 3), atol=1e-5)
    assert torch.all(support_size(batched) >= 1)


def test_candidate_fast_path_matches_full_sort():
    g = torch.Generator().manual_seed(4)
    n, vocab = 60, 200
    logits = torch.randn(n, vocab, generator=g) * torch.rand(n, 1, generator=g) * 6
    logits[:5, :] = torch.round(logits[:5, :])  # many exact ties, also at top-k boundaries
    top_k = torch.randint(0, 12, (n,), generator=g)
    top_p = torch.where(torch.rand(n, generator=g) < 0.3, 1.0, torch.rand(n, generator=g))
    temp = 0.5 + torch.rand(n, generator=g)
    ref = processed_logprobs(logits, temp, top_k, top_p, candidates=10**9)  # full-sort path
    assert torch.allclose(ref.exp().sum(-1), torch.ones(n), atol=1e-5)
    for cand in (1, 3, 8, 40, 150):
        got = processed_logprobs(logits, temp, top_k, top_p, candidates=cand)
        # Tie-free rows: the same distribution.
        assert torch.equal(torch.isfinite(got[5:]), torch.isfinite(ref[5:])), cand
        fin = torch.isfinite(ref[5:])
        assert torch.allclose(got[5:][fin], ref[5:][fin], atol=1e-5), cand
        # Rows with ties: which of equally likely tokens a top-p cut drops depends on the sort
        # order (as in vLLM), but the kept values are the same.
        for r in range(5):
            a, b = got[r][torch.isfinite(got[r])].sort().values, ref[r][torch.isfinite(ref[r])].sort().values
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (cand, r)
    # top-k ties at the threshold are all kept, on both paths
    tied = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    for cand in (1, 2, 3, 10**9):
        assert int(support_size(processed_logprobs(tied, top_k=2, candidates=cand))) == 4


def test_top_logprobs_helper():
    proc = processed_logprobs(torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5], [0.0, 3.0, 1.0, 2.0, -2.0]]), top_k=2)
    ids, lps, complete = top_logprobs(proc, 3)
    assert ids.shape == lps.shape == (2, 3)
    assert ids[:, :2].tolist() == [[3, 0], [1, 3]]
    assert torch.isinf(lps[:, 2]).all()
    assert complete.tolist() == [True, True]
    _, _, complete = top_logprobs(processed_logprobs(torch.randn(2, 5)), 3)
    assert complete.tolist() == [False, False]
    with pytest.raises(ValueError):
        top_logprobs(proc, 0)
    rows = processed_logprobs(torch.randn(30, 40), top_k=torch.arange(30) % 12)
    for K in (1, 4, 8, 11, 40, 50):
        ids, lps, complete = top_logprobs(rows, K)
        assert ids.shape == (30, K)
        assert torch.equal(complete, support_size(rows) <= K), K


# ---------------------------------------------------------------------------- generation


@pytest.mark.parametrize("K", [2, 8], ids=["full_row_cdf", "head"])
def test_sampler_frequencies(K):
    from prodrl_pipelines.engines.local import _sample

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    proc = processed_logprobs(logits, top_p=0.97).expand(40000, -1).contiguous()
    ids, lps, complete = top_logprobs(proc, K)
    assert bool(complete.all()) == (K == 8)
    tok = _sample(proc, ids, lps, complete, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=6).double() / tok.numel()
    assert freq[5] == 0  # outside the support
    assert torch.allclose(freq, proc[0].exp().double(), atol=0.01)


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "t0.7_topk5", "topp0.9"])
def test_recorded_logprobs_rescore(engine: LocalEngine, params: SamplingParams):
    prompts = _prompts()
    recs = engine.generate(prompts, params, seed=11)
    assert [r.prompt_token_ids for r in recs] == prompts
    lengths = [len(r.output_token_ids) for r in recs]
    assert any(L < params.max_tokens for L in lengths), lengths  # some rows stop early
    assert max(lengths) == params.max_tokens or all(r.finish_reason == "stop" for r in recs)
    for r in recs:
        n = len(r.output_token_ids)
        assert len(r.output_logprobs) == len(r.top_token_ids) == len(r.top_logprobs) == n
        if r.finish_reason == "stop":
            assert r.output_token_ids[-1] in STOP
            assert not any(t in STOP for t in r.output_token_ids[:-1])
        else:
            assert n == params.max_tokens and not any(t in STOP for t in r.output_token_ids)
        assert r.output_text == engine.tokenizer.decode(r.output_token_ids, skip_special_tokens=False)

    scored = engine.score(prompts, [r.output_token_ids for r in recs], params)
    for r, s in zip(recs, scored):
        assert all(math.isfinite(v) for v in r.output_logprobs)
        assert s == pytest.approx(r.output_logprobs, abs=1e-4)


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "t0.7_topk5", "topp0.9"])
def test_samples_in_support_and_top_k_rows(engine: LocalEngine, params: SamplingParams):
    K = params.num_top_logprobs
    recs = engine.generate(_prompts(seed=5), params, seed=2)
    for r in recs:
        proc = _full_processed(engine, r, params)
        for t, (tok, lp, ids, lps) in enumerate(
            zip(r.output_token_ids, r.output_logprobs, r.top_token_ids, r.top_logprobs)
        ):
            assert math.isfinite(proc[t, tok].item())  # sampled inside the processed support
            assert len(ids) == len(lps) == K
            assert all(a >= b for a, b in zip(lps, lps[1:]))
            assert all(v >= TOP_LOGPROB_FLOOR for v in lps)
            if lp > lps[-1]:
                assert tok in ids
            if tok in ids:
                assert lps[ids.index(tok)] == pytest.approx(lp, abs=1e-6)
            # the recorded head is the processed head of the full-forward path
            want = proc[t].clamp(min=TOP_LOGPROB_FLOOR)
            assert torch.allclose(torch.tensor(lps), want[torch.tensor(ids)], atol=1e-4)


def test_support_complete(engine: LocalEngine):
    prompts = _prompts()
    complete = engine.generate(prompts, SamplingParams(top_k=4, num_top_logprobs=8), seed=0)
    assert all(r.support_complete for r in complete)
    # support < K: the head is padded with floor values that carry no mass
    assert all(sum(v > TOP_LOGPROB_FLOOR for v in row) == 4 for r in complete for row in r.top_logprobs)
    incomplete = engine.generate(prompts, SamplingParams(num_top_logprobs=8), seed=0)
    assert not any(r.support_complete for r in incomplete)


def test_determinism(engine: LocalEngine):
    prompts = _prompts(seed=9)
    params = SamplingParams(top_p=0.95, max_tokens=12)
    a = engine.generate(prompts, params, seed=123)
    b = engine.generate(prompts, params, seed=123)
    c = engine.generate(prompts, params, seed=124)
    assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
    assert [r.output_logprobs for r in a] == [r.output_logprobs for r in b]
    assert [r.output_token_ids for r in a] != [r.output_token_ids for r in c]


def test_bad_input(engine: LocalEngine):
    params = SamplingParams(max_tokens=2)
    assert engine.generate([], params) == []
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        engine.generate([[5], [6, 7], []], params)
    with pytest.raises(ValueError, match=rf"prompt 1 .*{VOCAB}"):
        engine.generate([[5], [6, VOCAB]], params)
    with pytest.raises(ValueError, match="prompt 0"):
        engine.generate([[-1]], params)
    with pytest.raises(ValueError, match="output 0"):
        engine.score([[5]], [[VOCAB + 3]], params)


def test_moe_rescore(moe_engine: LocalEngine):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, stop_token_ids=STOP)
    prompts = _prompts(seed=4)
    recs = moe_engine.generate(prompts, params, seed=7)
    scored = moe_engine.score(prompts, [r.output_token_ids for r in recs], params)
    for r, s in zip(recs, scored):
        assert len(r.output_token_ids) >= 1
        assert s == pytest.approx(r.output_logprobs, abs=1e-4)


def test_from_pretrained_bf16_checkpoint_runs_in_fp32(engine: LocalEngine, tmp_path):
    model = Qwen3ForCausalLM(engine.model.config)
    model.load_state_dict(engine.model.state_dict())
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    engine.tokenizer.save_pretrained(tmp_path)
    loaded = LocalEngine.from_pretrained(tmp_path)
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    params = PARAMS[1]
    recs = loaded.generate(_prompts(), params, seed=1)
    scored = loaded.score([r.prompt_token_ids for r in recs], [r.output_token_ids for r in recs], params)
    for r, s in zip(recs, scored):
        assert s == pytest.approx(r.output_logprobs, abs=1e-4)


def test_extra_draw_is_recorded_inside_the_support(engine: LocalEngine):
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=6, num_top_logprobs=5, record_extra_draw=True)
    recs = engine.generate(_prompts(8), params, seed=3)
    differs = 0
    for rec in recs:
        assert rec.extra_token_ids is not None and len(rec.extra_token_ids) == len(rec.output_token_ids)
        for t, (x, heads) in enumerate(zip(rec.extra_token_ids, rec.top_token_ids)):
            assert x in heads  # top_k <= K: the head is the whole support
            differs += x != rec.output_token_ids[t]
    assert differs > 0  # an independent draw, not a copy of the sampled token
    assert engine.generate(_prompts(2), SamplingParams(max_tokens=3), seed=0)[0].extra_token_ids is None
