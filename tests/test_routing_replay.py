"""MoE routing replay (R3): recorded routing through the store, replay in the trainer, its
diagnostics, and the sequence-level corrections (GSPO, CISPO, seq-MIS) against closed forms."""

import json
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.rl.batch import pack_minibatch
from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rl.logprobs import policy_logprobs
from prodrl_pipelines.rl.losses import POLICY_CORRECTIONS, CorrectionParams, TokenTerms
from prodrl_pipelines.rl.routing_replay import RoutingStats, capture_routing, moe_shape, own_routing, routers, set_routing
from prodrl_pipelines.rl.sequences import trajectory_sequences
from prodrl_pipelines.rl.trajectory import Call, Trajectory, trajectories_from_table
from prodrl_pipelines.trajectories.routing import (
    RoutingError, check_fits, decode_routing, encode_routing, from_vllm, smallest_dtype,
)


# ----------------------------------------------------------------------------- the stored blob


def test_routing_blob_round_trips_in_the_smallest_type():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 128, (37, 48, 8))
    blob = encode_routing(a)
    back = decode_routing(blob)
    assert back.dtype == np.uint8 and np.array_equal(back, a)
    assert len(blob) < a.size  # 1 byte per id at most, compressed
    assert decode_routing(encode_routing(np.full((2, 1, 2), 300))).dtype == np.uint16
    assert smallest_dtype(70000) == np.uint32
    assert decode_routing(encode_routing(np.zeros((0, 3, 2), dtype=np.int64))).shape == (0, 3, 2)


def test_bad_routing_blobs_name_the_problem():
    import base64
    import io

    with pytest.raises(RoutingError, match="zlib"):
        decode_routing(b"not zlib")
    with pytest.raises(RoutingError, match="positions, layers"):
        encode_routing(np.zeros((3, 2)))
    with pytest.raises(RoutingError, match="negative"):
        encode_routing(-np.ones((1, 1, 2), dtype=np.int64))
    buf = io.BytesIO()
    np.save(buf, np.arange(12, dtype=np.int32).reshape(2, 3, 2))
    assert from_vllm(base64.b64encode(buf.getvalue()).decode()).shape == (2, 3, 2)
    with pytest.raises(RoutingError, match="base64"):
        from_vllm("%%%")


def test_check_fits_names_each_mismatch():
    a = np.array([[[0, 1]], [[2, 3]], [[1, 2]]])  # 3 positions, 1 layer, k = 2
    assert check_fits(a, 2, 2, 0) is None  # 2 + 2 - 1 forwarded positions
    assert check_fits(a[1:], 2, 2, 1) is None  # from the second prompt position on
    assert "positions" in check_fits(a, 2, 3, 0)
    assert "layers" in check_fits(a, 2, 2, 0, layers=2)
    assert "experts per token" in check_fits(a, 2, 2, 0, k=4)
    assert "outside [0, 3)" in check_fits(a, 2, 2, 0, num_experts=3)
    assert "repeated" in check_fits(np.array([[[1, 1]], [[0, 1]], [[0, 1]]]), 2, 2, 0)
    assert "start" in check_fits(a, 2, 2, 5)


# ----------------------------------------------------------------------------- the engine and the store


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from prodrl_pipelines.lab.warmstart import build_base_policy

    return build_base_policy(tmp_path_factory.mktemp("r3") / "moe", size="demo", seed=0, sft_steps=5, progress=False)


def _prompts(n: int, vocab: int, seed: int = 0, length: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _noisy_selection(model, scale: float, seed: int = 0):
    """A deployment with the trainer's weights whose top-k *selection* sees noise on the router
    logits (as batch-dependent kernels and lower precision do at near-ties); the mixing weights are
    its exact router probabilities at the chosen experts."""
    g = torch.Generator().manual_seed(seed)

    def hook(module, args, output):
        logits, _, _ = output
        idx = torch.topk(logits + scale * torch.randn(logits.shape, generator=g), module.top_k, dim=-1).indices
        w = torch.softmax(logits, -1, dtype=torch.float).gather(-1, idx)
        w = w / w.sum(-1, keepdim=True) if module.norm_topk_prob else w
        return logits, w.to(output[1].dtype), idx

    for r in routers(model):
        r.register_forward_hook(hook)


def test_local_engine_records_routing_that_replays_to_its_own_forward(moe_dir):
    """The engine records every forwarded position's experts; a trainer with the same weights
    reproduces the engine's log-probs with replay even where its own routing differs."""
    deploy = LocalEngine.from_pretrained(moe_dir)
    _noisy_selection(deploy.model, 0.3)
    trainer = LocalEngine.from_pretrained(moe_dir).model
    layers, k, experts = moe_shape(trainer)
    prompts = _prompts(6, deploy.vocab_size)
    recs = deploy.generate(prompts, SamplingParams(max_tokens=8, num_top_logprobs=4, record_routing=True), seed=1)
    for p, r in zip(prompts, recs):
        assert r.routed_experts.shape == (len(p) + len(r.output_token_ids) - 1, layers, k)
        assert r.routed_experts.dtype == np.uint8 and r.routed_experts.max() < experts
    assert deploy.generate(prompts[:1], SamplingParams(max_tokens=2), seed=1)[0].routed_experts is None  # off

    calls = [Call(r.prompt_token_ids, r.output_token_ids, r.output_logprobs, 1.0, r.top_token_ids, r.top_logprobs,
                  r.support_complete, routing=r.routed_experts) for r in recs]
    trajs = [Trajectory(f"t{i}", "", "v0", 1.0, [c]) for i, c in enumerate(calls)]
    b = pack_minibatch(trajs, np.ones(len(trajs)), pad_id=0, with_routing=True)
    stats = RoutingStats()
    with torch.no_grad():
        replayed = policy_logprobs(trainer, b, replay=True, routing_stats=stats)[:, 0]
        own = policy_logprobs(trainer, b, replay=False)[:, 0]
    assert 0.02 < stats.disagreement < 0.9  # the construction flips routing
    assert (replayed - b.logp_mu).abs().max() < 2e-5  # fp32: the deployment's own forward
    assert (own - b.logp_mu).abs().max() > 100 * (replayed - b.logp_mu).abs().max()
    set_routing(trainer, None)


def test_routing_survives_the_store_and_selection(moe_dir, tmp_path):
    from prodrl_pipelines.lab.episodes import routing_fields
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.selection import select_round_dataset
    from prodrl_pipelines.trajectories.store import TrajectoryStore
    from tests.helpers import make_call, make_reward

    eng = LocalEngine.from_pretrained(moe_dir)
    shape = moe_shape(eng.model)
    prompts = _prompts(4, eng.vocab_size, seed=2)
    recs = eng.generate(prompts, SamplingParams(max_tokens=5, num_top_logprobs=3, record_routing=True), seed=0)
    rows = []
    for i, r in enumerate(recs):
        rows.append(make_call(f"t{i}", 0, vocab=eng.vocab_size, prompt_token_ids=r.prompt_token_ids,
                              output_token_ids=r.output_token_ids, output_logprobs=r.output_logprobs,
                              top_token_ids=r.top_token_ids, top_logprobs=r.top_logprobs, **routing_fields(r)))
    rows[1]["routed_experts"] = encode_routing(recs[1].routed_experts[:-1])  # one position short
    rows[2]["routed_experts"] = b"garbage"
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    store.write_calls([make_call("old", 0, vocab=eng.vocab_size)])  # a dense-model call: no routing
    store.write_calls(rows)
    store.write_rewards([make_reward(t) for t in ("old", "t0", "t1", "t2", "t3")])
    back = store.read_calls().sort_by("trajectory_id")
    assert back.column("routed_experts").null_count == 1
    sel = select_round_dataset(store, "round-000001", "v0", ["v0"], 0, 3, eng.vocab_size, routing_shape=shape)
    assert sel.quarantine_counts["bad_routing"] == 2
    reasons = store.read_quarantine("round-000001").column("quarantine_reason").to_pylist()
    assert any("positions" in r for r in reasons) and any("zlib" in r for r in reasons)
    trajs = {t.trajectory_id: t for t in trajectories_from_table(sel.dataset)}
    assert trajs["old"].calls[0].routing is None
    for i in (0, 3):
        assert np.array_equal(trajs[f"t{i}"].calls[0].routing, recs[i].routed_experts)
    # a model of another MoE shape quarantines every recorded call
    from prodrl_pipelines.trajectories.validation import validate_rows

    other = validate_rows(store.read_calls(dedupe=False), store.read_rewards(), eng.vocab_size, {"v0"},
                          check_top=True, check_prompt=True, routing_shape=(shape[0] + 1, shape[1], shape[2]))
    assert other.result().counts["bad_routing"] == 4


def test_a_table_written_before_the_routing_columns_gains_them(tmp_path):
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.schema import CALL_SCHEMA
    from prodrl_pipelines.trajectories.store import CALLS, PARTITION_BY, STORED, TrajectoryStore
    from tests.helpers import make_call

    store = TrajectoryStore(LocalBlobStore(tmp_path / "s"))
    old_schema = pa.schema([f for f in CALL_SCHEMA if not f.name.startswith("routed_experts")])
    old = pa.Table.from_pylist([{k: v for k, v in make_call("a").items() if k in old_schema.names}], schema=old_schema)
    stored = pa.schema([f for f in STORED[CALLS] if not f.name.startswith("routed_experts")])
    old = old.append_column("_part", pa.array(["00"], pa.string())).append_column("_row", pa.array([0], pa.int32()))
    store.tables.append(CALLS, old.select(stored.names).cast(stored), PARTITION_BY[CALLS])
    assert store.read_calls().column("routed_experts").to_pylist() == [None]  # read as nulls
    store.write_calls([make_call("b", routed_experts=encode_routing(np.zeros((8, 1, 2), dtype=int) + [0, 1]),
                                 routed_experts_start=0)])
    t = store.read_calls().sort_by("trajectory_id")
    assert t.column("routed_experts_start").to_pylist() == [None, 0]
    assert decode_routing(t.column("routed_experts")[1].as_py()).shape == (8, 1, 2)


# ----------------------------------------------------------------------------- sequences and replay


def test_merged_calls_take_each_position_from_the_earliest_call():
    r1 = np.array([[[0, 1]]] * 4)  # call 1: 3 prompt + 2 output ids -> 4 positions
    r2 = np.array([[[2, 3]]] * 8)  # call 2 extends it: 7 prompt + 2 output -> 8 positions
    c1 = Call([1, 2, 3], [4, 5], [-1.0, -1.0], 1.0, routing=r1)
    c2 = Call([1, 2, 3, 4, 5, 6, 7], [8, 9], [-1.0, -1.0], 1.0, routing=r2)
    c3 = Call([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11], [-1.0], 1.0)  # no routing recorded
    (seq,) = trajectory_sequences(Trajectory("t", "", "v0", 1.0, [c1, c2, c3]), 1.0, 1, 0)
    routing, known = seq.routing()
    assert seq.num_inputs == 10 and routing.shape == (10, 1, 2)
    assert routing[:4, 0, 0].tolist() == [0] * 4 and routing[4:8, 0, 0].tolist() == [2] * 4
    assert known.tolist() == [True] * 8 + [False] * 2
    c2_late = Call(c2.prompt_ids, c2.output_ids, c2.output_logprobs, 1.0, routing=r2[5:], routing_start=5)
    routing, known = trajectory_sequences(Trajectory("t", "", "v0", 1.0, [c1, c2_late]), 1.0, 1, 0)[0].routing()
    assert known.tolist() == [True] * 4 + [False] + [True] * 3


def test_replay_sends_gradients_to_the_router(moe_dir):
    model = LocalEngine.from_pretrained(moe_dir).model.train()
    ids = torch.tensor(_prompts(2, model.config.vocab_size, seed=3))
    own = torch.from_numpy(own_routing(model, ids))
    flipped = own.clone()
    flipped[..., 0] = (own[..., 1] + 1) % moe_shape(model)[2]  # other expert sets, still distinct
    flipped[..., 0] = torch.where(flipped[..., 0] == own[..., 1], (flipped[..., 0] + 1) % moe_shape(model)[2],
                                  flipped[..., 0])
    grads = {}
    for name, routing in (("own", own), ("flipped", flipped)):
        model.zero_grad()
        set_routing(model, routing)
        model(input_ids=ids).logits.log_softmax(-1)[..., 5].sum().backward()
        grads[name] = torch.cat([r.weight.grad.flatten() for r in routers(model)])
    set_routing(model, None)
    model.zero_grad()
    model(input_ids=ids).logits.log_softmax(-1)[..., 5].sum().backward()
    free = torch.cat([r.weight.grad.flatten() for r in routers(model)])
    assert grads["flipped"].abs().sum() > 0
    assert torch.allclose(grads["own"], free, atol=1e-6)  # replaying its own choice changes nothing
    assert not torch.allclose(grads["flipped"], free, atol=1e-4)


def test_capture_is_empty_for_a_dense_model(tmp_path):
    from prodrl_pipelines.lab.model import build_model, lab_model_config

    dense = build_model(lab_model_config("tiny-dense", vocab_size=50))
    assert moe_shape(dense) is None and not set_routing(dense, torch.zeros(1, 2, 1, 2, dtype=torch.long))
    with capture_routing(dense) as cap:
        dense(input_ids=torch.tensor([[1, 2]]))
    assert cap.layers == []


def test_a_round_reports_routing_and_replays_when_asked(moe_dir):
    from prodrl_pipelines.rl.checkpoint import TrainerState
    from prodrl_pipelines.rl.trainer import build_optimizer, train_round

    deploy = LocalEngine.from_pretrained(moe_dir)
    _noisy_selection(deploy.model, 0.3, seed=4)
    prompts = _prompts(8, deploy.vocab_size, seed=5)
    recs = deploy.generate(prompts, SamplingParams(max_tokens=6, num_top_logprobs=4, record_routing=True), seed=2)
    trajs = [Trajectory(f"t{i}", "", "v0", float(i % 2), [Call(r.prompt_token_ids, r.output_token_ids,
             r.output_logprobs, 1.0, r.top_token_ids, r.top_logprobs, r.support_complete, routing=r.routed_experts)])
             for i, r in enumerate(recs)]
    out = {}
    for mode in ("none", "recorded"):
        model = LocalEngine.from_pretrained(moe_dir).model
        recipe = Recipe(steps_per_round=2, batch_size=4, routing_replay=mode, correction="tis")
        state = TrainerState()
        res = train_round(model, build_optimizer(model, recipe, state), trajs, np.array([1.0, -1.0] * 4),
                          [[0, 1, 2, 3], [4, 5, 6, 7]], recipe, state, pad_id=0, round_seed=0, progress=False)
        out[mode] = res
    for res in out.values():
        assert res.routing["routing_disagreement"] > 0.02
        assert res.routing["mismatch_replay_mean"] < 1e-4 < res.routing["mismatch_no_replay_mean"]
        assert res.routing["mismatch_replay_p99"] < res.routing["mismatch_no_replay_p99"]
    assert out["recorded"].mismatch_abs_logp < 1e-4 < out["none"].mismatch_abs_logp
    assert out["recorded"].steps[0]["engine_mismatch"] < 1e-4


def test_dense_policy_ignores_routing_replay_with_a_warning(tmp_path):
    from prodrl_pipelines.lab.model import build_model, lab_model_config
    from prodrl_pipelines.rl.checkpoint import TrainerState
    from prodrl_pipelines.rl.trainer import build_optimizer, train_round

    model = build_model(lab_model_config("tiny-dense", vocab_size=50))
    calls = [Call([1, 2, 3], [4, 5], [-1.0, -2.0], 1.0, [[4, 6]] * 2, [[-1.0, -2.0]] * 2) for _ in range(4)]
    trajs = [Trajectory(f"t{i}", "", "v0", float(i), [c]) for i, c in enumerate(calls)]
    recipe = Recipe(steps_per_round=1, batch_size=4, routing_replay="recorded")
    state = TrainerState()
    with pytest.warns(UserWarning, match="no MoE router"):
        res = train_round(model, build_optimizer(model, recipe, state), trajs, np.array([1.0, -1.0, 0.5, -0.5]),
                          [[0, 1, 2, 3]], recipe, state, pad_id=0, round_seed=0, progress=False)
    assert res.routing == {}


# ----------------------------------------------------------------------------- sequence-level corrections

F64 = torch.float64


def _terms(rng, n_tok=(3, 5, 2)):
    seq = torch.tensor(np.repeat(np.arange(len(n_tok)), n_tok))
    G = int(seq.numel())
    logp = torch.tensor(np.log(rng.uniform(0.05, 0.9, G)), dtype=F64).requires_grad_()
    old = (logp.detach() + torch.tensor(rng.normal(0, 0.05, G), dtype=F64))
    mu = old + torch.tensor(rng.normal(0, 0.1, G), dtype=F64)
    adv = torch.tensor(np.repeat(rng.normal(0, 1, len(n_tok)), n_tok), dtype=F64)
    return TokenTerms(logp, old, mu, adv, seq=seq, trained=torch.ones(G, dtype=torch.bool)), seq, n_tok


@pytest.mark.parametrize("seed", range(5))
def test_gspo_matches_its_closed_form(seed):
    rng = np.random.default_rng(seed)
    p = CorrectionParams(gspo_eps_low=0.01, gspo_eps_high=0.02)
    t, seq, n_tok = _terms(rng)
    w = torch.tensor(np.repeat([1 / (3 * n) for n in n_tok], n_tok), dtype=F64)  # 1/(B T_i)
    j, diag = POLICY_CORRECTIONS["gspo"](t, p)
    J = (w * t.adv * j).sum()
    J.backward()
    lp, old, adv = t.logp.detach().numpy(), t.logp_old.numpy(), t.adv.numpy()
    want_J, want_grad = 0.0, np.zeros_like(lp)
    for i, n in enumerate(n_tok):
        m = seq.numpy() == i
        s = math.exp(np.mean(lp[m] - old[m]))
        a = adv[m][0]
        c = min(max(s, 1 - 0.01), 1 + 0.02)
        val = min(s * a, c * a)
        want_J += val / 3
        if s * a <= c * a:  # the unclipped side is the pessimistic one: d(s A)/d logp_t = A s / T_i
            want_grad[m] = a * s / n / 3
    assert J.item() == pytest.approx(want_J, rel=1e-12)
    assert t.logp.grad.numpy() == pytest.approx(want_grad, rel=1e-10, abs=1e-15)
    assert 0 <= diag["seq_clip_frac"] <= 1


@pytest.mark.parametrize("seed", range(5))
def test_cispo_matches_its_closed_form(seed):
    rng = np.random.default_rng(seed)
    p = CorrectionParams(cispo_low=0.9, cispo_high=1.05)
    t, _, _ = _terms(rng)
    j, diag = POLICY_CORRECTIONS["cispo"](t, p)
    j.sum().backward()
    r = np.exp(t.logp.detach().numpy() - t.logp_mu.numpy())
    w = np.clip(r, 0.9, 1.05)
    assert j.detach().numpy() == pytest.approx(w * t.logp.detach().numpy(), rel=1e-12)
    assert t.logp.grad.numpy() == pytest.approx(w, rel=1e-12)  # no token's gradient is dropped
    assert diag["is_truncated_frac"] == pytest.approx(np.mean((r < 0.9) | (r > 1.05)))


@pytest.mark.parametrize("seed", range(5))
def test_seq_mis_rejects_whole_trajectories_by_geometric_mean(seed):
    rng = np.random.default_rng(seed)
    p = CorrectionParams(seq_mis_low=0.97, seq_mis_high=1.03)
    t, seq, n_tok = _terms(rng, (4, 6, 3, 5))
    j, diag = POLICY_CORRECTIONS["seq_mis"](t, p)
    j.sum().backward()
    lp, old, mu, adv = t.logp.detach().numpy(), t.logp_old.numpy(), t.logp_mu.numpy(), t.adv.numpy()
    for i in range(len(n_tok)):
        m = seq.numpy() == i
        g = math.exp(np.mean(old[m] - mu[m]))
        keep = 0.97 <= g <= 1.03
        r = np.exp(lp[m] - old[m])
        c = np.clip(r, 0.8, 1.2)
        want = np.where(adv[m] >= 0, np.minimum(r, c), np.maximum(r, c)) * keep
        assert j.detach().numpy()[m] == pytest.approx(want, rel=1e-12)
        if not keep:
            assert np.all(t.logp.grad.numpy()[m] == 0)
    assert 0 <= diag["seq_rejected_frac"] <= 1


def test_sequence_level_corrections_keep_a_trajectory_in_one_micro_batch():
    from prodrl_pipelines.rl.trainer import layout_round

    def call(prompt):
        return Call(prompt, [7, 8], [-1.0, -1.0], 1.0, [[7, 8]] * 2, [[-1.0, -2.0]] * 2)

    # two calls whose prompts do not extend: two sequences of one trajectory
    trajs = [Trajectory(f"t{i}", "", "v0", 1.0, [call([1] * 20), call([2] * 20)]) for i in range(4)]
    plan = [[0, 1, 2, 3]]
    adv = np.array([1.0, -1.0, 1.0, -1.0])
    for correction, together in (("tis", False), ("gspo", True), ("seq_mis", True)):
        recipe = Recipe(steps_per_round=1, batch_size=4, correction=correction, max_tokens_per_microbatch=30)
        ((seqs, micro),), _ = layout_round(trajs, adv, plan, recipe)
        owners = [{seqs[i].spans[0].traj for i in mb} for mb in micro]
        split = any(len([mb for mb in micro if any(seqs[i].spans[0].traj == t for i in mb)]) > 1 for t in range(4))
        assert split is not together, (correction, owners)


# ----------------------------------------------------------------------------- served and recorded


@pytest.fixture(scope="module")
def routed_upstream(moe_dir):
    from prodrl_pipelines.engines.server import BackgroundServer, build_app

    eng = LocalEngine.from_pretrained(moe_dir)
    app = build_app(eng, model_dir=moe_dir, served_model_name="v0", batch_wait_ms=1, return_routed_experts=True)
    with BackgroundServer(app) as srv:
        yield srv, eng


@pytest.mark.parametrize("kind,stream", [("completion", False), ("completion", True), ("chat", False)])
def test_prodrl_serve_returns_routing_as_vllm_and_the_recorder_stores_it(routed_upstream, moe_dir, tmp_path,
                                                                          kind, stream):
    """``prodrl serve --enable-return-routed-experts`` answers vLLM's ``routed_experts`` (base64 .npy
    [P + O - 1 - start, layers, k]); the recorder stores it per call, equal to the local engine's
    routing for the same seed, honouring ``routed_experts_prompt_start``."""
    import httpx

    from prodrl_pipelines.engines.openai_protocol import iter_sse_data
    from prodrl_pipelines.engines.server import BackgroundServer
    from prodrl_pipelines.lab.episodes import render_prompt, stop_token_ids
    from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app

    srv, eng = routed_upstream
    prompt = _prompts(1, eng.vocab_size, seed=9)[0]
    start = 3
    if kind == "completion":
        path, body, ids = "/v1/completions", {"prompt": prompt, "max_tokens": 6, "seed": 5}, prompt
    else:
        messages = [{"role": "user", "content": "7+5="}]
        path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "seed": 5}
        ids = render_prompt(eng.tokenizer, messages)[1]
    body = {**body, "routed_experts_prompt_start": start, "stream": stream}
    params = SamplingParams(max_tokens=6, num_top_logprobs=20, record_routing=True,
                            stop_token_ids=tuple(stop_token_ids(eng.tokenizer)))
    want = eng.generate([ids], params, seed=5)[0]
    with httpx.Client(base_url=srv.url, timeout=60) as direct:
        if not stream:
            answer = direct.post(path, json=body).json()
            got = from_vllm(answer["choices"][0]["routed_experts"])
            assert np.array_equal(got, want.routed_experts[start:])
        bad = direct.post(path, json={**body, "stream": False, "routed_experts_prompt_start": len(ids) + 1})
        assert bad.status_code == 400 and "routed_experts_prompt_start" in bad.text
    cfg = RecorderConfig(upstream=srv.url, store_dir=str(tmp_path / "store"), tokenizer_dir=str(moe_dir), token="t")
    app = build_recorder_app(cfg)
    with BackgroundServer(app) as rec, httpx.Client(base_url=rec.url, timeout=60,
                                                    headers={"Authorization": "Bearer t"}) as c:
        resp = c.post(path, json=body, headers={"X-Trajectory-Id": "x"})
        assert resp.status_code == 200
        if stream:  # the routing is for the record: the client's answer does not carry it
            chunks = [json.loads(d) for d in iter_sse_data(resp.text.split("\n")) if d != "[DONE]"]
            assert chunks and all("routed_experts" not in ch for c_ in chunks for ch in c_["choices"])
        else:
            assert "routed_experts" not in resp.json()["choices"][0]
        assert app.state.recorder.ingestor.flush(30)
        row = app.state.recorder.store.read_calls().to_pylist()[0]
        assert c.get("/stats").json()["counters"]["routing_recorded"] == 1
    assert row["output_token_ids"] == want.output_token_ids and row["routed_experts_start"] == start
    assert np.array_equal(decode_routing(row["routed_experts"]), want.routed_experts[start:])
    assert check_fits(decode_routing(row["routed_experts"]), len(ids), len(want.output_token_ids), start) is None


def test_rescoring_and_the_parity_probe_replay_the_served_routing(moe_dir, routed_upstream):
    """``LocalEngine.score(routings=)`` (what the parity probe scores with) reproduces a deployment
    whose routing differs from the trainer's; the probe replays the routing a server returned when
    the recipe replays routing."""
    from prodrl_pipelines.config.settings import Settings
    from prodrl_pipelines.deploy_targets.probe import parity_probe

    deploy = LocalEngine.from_pretrained(moe_dir)
    _noisy_selection(deploy.model, 0.3, seed=7)
    trainer = LocalEngine.from_pretrained(moe_dir)
    prompts = _prompts(6, deploy.vocab_size, seed=8)
    params = SamplingParams(max_tokens=8, num_top_logprobs=4, record_routing=True)
    recs = deploy.generate(prompts, params, seed=3)
    outs = [r.output_token_ids for r in recs]
    mu = np.concatenate([r.output_logprobs for r in recs])
    replayed = np.concatenate(trainer.score(prompts, outs, params, routings=[r.routed_experts for r in recs]))
    own = np.concatenate(trainer.score(prompts, outs, params))
    assert np.abs(replayed - mu).max() < 2e-5 < np.abs(own - mu).max()
    srv, _ = routed_upstream
    for replay in ("none", "recorded"):
        s = Settings(recipe={"routing_replay": replay}, deploy={"probe_prompts": 4})
        res = parity_probe(s, moe_dir, prompts[:4], srv.url, served_model_name="v0")
        assert res.passed and res.mean_abs < 1e-4, res
