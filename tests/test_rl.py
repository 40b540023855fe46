"""Advantages, loss aggregation, the trainer and its carried state, against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from prodrl_pipelines.rl.advantages import BaselineState, compute_advantages
from prodrl_pipelines.rl.trajectory import Call, Trajectory
from prodrl_pipelines.rl.batch import pack_minibatch
from prodrl_pipelines.rl.checkpoint import TrainerState, load_policy, load_trainer_state, save_checkpoint
from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rl.logprobs import token_logprobs
from prodrl_pipelines.rl.losses import TokenTerms, policy_objective
from prodrl_pipelines.rl.trainer import build_optimizer, plan_minibatches, train_round


# --- advantages ---------------------------------------------------------------------------
def test_loo_baseline_hand_computed():
    adv = compute_advantages([1.0, 0.0, 0.5], "loo")
    # b_0 = (0 + .5)/2, b_1 = (1 + .5)/2, b_2 = (1 + 0)/2
    np.testing.assert_allclose(adv, [1 - 0.25, 0 - 0.75, 0.5 - 0.5])


def test_batch_mean_and_std_normalisation():
    r = np.array([1.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(compute_advantages(r, "batch_mean"), r - 0.5)
    np.testing.assert_allclose(compute_advantages(r, "batch_mean", normalize_std=True), (r - 0.5) / (0.5 + 1e-6))


def test_ema_baseline_carries_across_rounds():
    st = BaselineState()
    a1 = compute_advantages([1.0, 0.0], "ema", state=st, ema_decay=0.5)
    np.testing.assert_allclose(a1, [0.5, -0.5])  # first round: own mean
    assert st.ema == pytest.approx(0.5)
    a2 = compute_advantages([1.0, 1.0], "ema", state=st, ema_decay=0.5)
    np.testing.assert_allclose(a2, [0.5, 0.5])  # baseline = previous running mean 0.5
    assert st.ema == pytest.approx(0.75)


def test_task_group_baseline():
    adv = compute_advantages([1.0, 0.0, 0.3], "task_group", task_ids=["a", "a", "b"])
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.3])


def test_loo_closed_form_property():
    # A_i = R_i - mean_{j != i} R_j = n/(n-1) * (R_i - mean(R)), so sum_i A_i = 0.
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 50))
        r = rng.normal(size=n)
        a = compute_advantages(r, "loo")
        np.testing.assert_allclose(a, n / (n - 1) * (r - r.mean()), atol=1e-12)
        assert abs(a.sum()) < 1e-9


def test_non_finite_rewards_rejected():
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([1.0, float("nan")], "loo")


def test_recipe_validation_names_setting():
    with pytest.raises(Exception, match="correction"):
        Recipe(correction="nope")
    with pytest.raises(Exception, match="baseline"):
        Recipe(baseline="nope")
    assert Recipe().trajectories_per_round == Recipe().steps_per_round * Recipe().batch_size


# --- aggregation ----------------------------------------------------------------------------
def _traj(tid, reward, calls):
    return Trajectory(tid, tid, "v0", reward, [Call(p, o, [-(i + 1) * 0.1 for i in range(len(o))], 1.0) for p, o in calls])


def test_pack_minibatch_weights_and_alignment():
    t0 = _traj("a", 1.0, [([5, 6], [7]), ([5, 6, 7, 8], [9, 10])])  # T = 3, two calls
    t1 = _traj("b", 0.0, [([4], [3])])  # T = 1
    b = pack_minibatch([t0, t1], np.array([0.5, -0.5]), pad_id=0)
    assert b.input_ids.shape == (3, 5)
    # targets are exactly the generated tokens, predicted from the position before each
    assert b.targets.tolist() == [7, 9, 10, 3]
    assert b.gen_pos.tolist() == [1, 3, 4, 0]
    for r, p, t in zip(b.gen_row.tolist(), b.gen_pos.tolist(), b.targets.tolist()):
        full = [[5, 6, 7], [5, 6, 7, 8, 9, 10], [4, 3]][r]
        assert full[p + 1] == t
    np.testing.assert_allclose(b.weight.numpy(), [1 / 6, 1 / 6, 1 / 6, 1 / 2])
    np.testing.assert_allclose(b.adv.numpy(), [0.5, 0.5, 0.5, -0.5])
    np.testing.assert_allclose(b.logp_mu.numpy(), [-0.1, -0.1, -0.2, -0.1], rtol=1e-6)


def test_objective_is_mean_over_trajectories_of_per_token_mean():
    logp = torch.tensor([-1.0, -2.0, -3.0, -0.5], requires_grad=True)
    adv = torch.tensor([2.0, 2.0, 2.0, -1.0])
    w = torch.tensor([1 / 6, 1 / 6, 1 / 6, 1 / 2])
    terms = TokenTerms(logp, logp.detach(), logp.detach(), adv)
    J, _ = policy_objective(terms, w, "none")
    expected = 0.5 * (2.0 * (-1 - 2 - 3) / 3 + (-1.0) * (-0.5) / 1)
    assert J.item() == pytest.approx(expected)
    J.backward()
    np.testing.assert_allclose(logp.grad.numpy(), (w * adv).numpy())


def test_reinforce_gradient_matches_closed_form_on_softmax():
    # E_{a~pi}[A(a) grad_z log pi(a)] = sum_a pi(a) A(a) (e_a - pi): the estimator's mean, exactly.
    torch.manual_seed(0)
    z = torch.randn(5, requires_grad=True)
    A = torch.randn(5)
    pi = torch.softmax(z, -1)
    J = (pi.detach() * A * torch.log_softmax(z, -1)).sum()
    (g,) = torch.autograd.grad(J, z)
    closed = sum(pi[a].item() * A[a].item() * (torch.eye(5)[a] - pi.detach()) for a in range(5))
    torch.testing.assert_close(g, closed)


# --- trainer ----------------------------------------------------------------------------------
def _tiny_model(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).float()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(32)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def _random_trajs(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        calls = [(rng.integers(3, 32, rng.integers(2, 6)).tolist(), rng.integers(3, 32, rng.integers(1, 4)).tolist())
                 for _ in range(2)]
        out.append(_traj(f"t{i:03d}", float(rng.random() < 0.5), calls))
    return out


def test_token_logprobs_match_full_forward():
    model = _tiny_model()
    trajs = _random_trajs(3)
    b = pack_minibatch(trajs, np.ones(3), pad_id=0)
    b.temperature[:] = 0.7
    got = token_logprobs(model, b)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    ref = torch.log_softmax(logits[b.gen_row, b.gen_pos] / 0.7, -1).gather(-1, b.targets[:, None]).squeeze(-1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_round_split_by_checkpoint_equals_uninterrupted(tmp_path):
    """Adam state saved with the checkpoint and restored: 2 rounds of 1 step == 1 run of 2 steps."""
    recipe = Recipe(steps_per_round=1, batch_size=2, learning_rate=1e-2)
    trajs = _random_trajs(4, seed=1)
    adv = compute_advantages([t.reward for t in trajs], "batch_mean") + 0.1

    m_a = _tiny_model()
    st_a = TrainerState()
    opt_a = build_optimizer(m_a, recipe, st_a)
    recipe2 = Recipe(steps_per_round=2, batch_size=2, learning_rate=1e-2)
    train_round(m_a, opt_a, trajs, adv, [[0, 1], [2, 3]], recipe2, st_a, 0, 0, progress=False)

    m_b = _tiny_model()
    st_b = TrainerState()
    opt_b = build_optimizer(m_b, recipe, st_b)
    train_round(m_b, opt_b, trajs, adv, [[0, 1]], recipe, st_b, 0, 0, progress=False)
    save_checkpoint(tmp_path / "ck", m_b, _tiny_tokenizer(), opt_b, st_b)
    m_c, _ = load_policy(tmp_path / "ck")
    st_c = load_trainer_state(tmp_path / "ck")
    assert st_c.global_step == 1 and st_c.optimizer is not None
    opt_c = build_optimizer(m_c, recipe, st_c)
    train_round(m_c, opt_c, trajs, adv, [[2, 3]], recipe, st_c, 0, 0, progress=False)
    assert st_c.global_step == st_a.global_step == 2
    for (n, p), q in zip(m_a.named_parameters(), m_c.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)

    # Without the Adam state the result differs (the test can fail).
    m_d, _ = load_policy(tmp_path / "ck")
    opt_d = build_optimizer(m_d, recipe, TrainerState())
    train_round(m_d, opt_d, trajs, adv, [[2, 3]], recipe, TrainerState(), 0, 0, progress=False)
    assert not all(torch.allclose(p, q, atol=1e-6) for p, q in zip(m_a.parameters(), m_d.parameters()))


def test_zero_advantage_step_is_skipped_and_counted():
    model = _tiny_model()
    recipe = Recipe(steps_per_round=2, batch_size=2)
    trajs = _random_trajs(4)
    before = [p.detach().clone() for p in model.parameters()]
    st = TrainerState()
    res = train_round(model, build_optimizer(model, recipe, st), trajs, np.zeros(4), [[0, 1], [2, 3]], recipe, st,
                      0, 0, progress=False)
    assert res.skipped_steps == 2 and st.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert math.isfinite(res.mismatch_abs_logp)


def test_reinforce_raises_rewarded_sequence_probability():
    model = _tiny_model()
    good = _traj("g", 1.0, [([3, 4, 5], [6, 7])])
    bad = _traj("b", 0.0, [([3, 4, 5], [8, 9])])
    trajs = [good, bad] * 2
    recipe = Recipe(steps_per_round=2, batch_size=2, learning_rate=1e-2)
    b = pack_minibatch([good, bad], np.zeros(2), 0)
    lp0 = token_logprobs(model, b).detach()
    st = TrainerState()
    adv = compute_advantages([t.reward for t in trajs], "loo")
    train_round(model, build_optimizer(model, recipe, st), trajs, adv, [[0, 1], [2, 3]], recipe, st, 0, 0,
                progress=False)
    lp1 = token_logprobs(model, b).detach()
    assert (lp1[:2] - lp0[:2]).sum() > 0 > (lp1[2:] - lp0[2:]).sum()


def test_plan_needs_enough_trajectories():
    with pytest.raises(ValueError, match="steps_per_round=4 x batch_size=2"):
        plan_minibatches(_random_trajs(3), Recipe(steps_per_round=4, batch_size=2), 0)
    plan = plan_minibatches(_random_trajs(8), Recipe(steps_per_round=4, batch_size=2), 0)
    assert sorted(i for mb in plan for i in mb) == list(range(8))


def _trajs_with_heads(n, K=4, seed=0, top_k=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        calls = []
        for _ in range(2):
            P, O = rng.integers(2, 6), rng.integers(1, 4)
            outs = rng.integers(3, 32, O).tolist()
            top_ids, top_lps = [], []
            for a in outs:
                ids = [a] + rng.choice([v for v in range(3, 32) if v != a], K - 1, replace=False).tolist()
                lps = np.sort(np.log(rng.dirichlet(np.ones(K)) * 0.9))[::-1].tolist()
                top_ids.append(ids)
                top_lps.append(lps)
            calls.append(Call(rng.integers(3, 32, P).tolist(), outs, [top_lps[t][0] for t in range(O)], 1.0,
                              top_ids, top_lps, support_complete=bool(top_k), top_k=top_k))
        out.append(Trajectory(f"h{i:03d}", "t", "v0", float(i % 2), calls))
    return out


@pytest.mark.parametrize("correction", ["none", "tis", "ref_is", "cis", "icepop", "score_centering"])
@pytest.mark.parametrize("top_k", [0, 4])
def test_every_correction_trains_a_round(correction, top_k):
    model = _tiny_model()
    recipe = Recipe(steps_per_round=2, batch_size=2, correction=correction, kl_beta=0.1)
    trajs = _trajs_with_heads(4, top_k=top_k)
    st = TrainerState()
    ref = _tiny_model(seed=1) if correction == "ref_is" else None
    adv = compute_advantages([t.reward for t in trajs], "loo")
    res = train_round(model, build_optimizer(model, recipe, st), trajs, adv, [[0, 1], [2, 3]], recipe, st, 0, 0,
                      progress=False, reference_model=ref)
    assert st.global_step == 2
    for m in res.steps:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["kl"] >= 0 and m["staleness"] >= 0
    if correction in ("tis", "cis", "icepop", "ref_is"):
        assert "is_weight_mean" in res.steps[0] and "ppo_clip_frac" in res.steps[0]


def test_ref_is_without_reference_fails_clearly():
    model = _tiny_model()
    recipe = Recipe(steps_per_round=1, batch_size=2, correction="ref_is")
    trajs = _trajs_with_heads(2)
    with pytest.raises(ValueError, match="reference model"):
        train_round(model, build_optimizer(model, recipe, TrainerState()), trajs, np.array([1.0, -1.0]), [[0, 1]],
                    recipe, TrainerState(), 0, 0, progress=False)


def test_sampled_score_centering_uses_recorded_extra_draw():
    model = _tiny_model()
    recipe = Recipe(steps_per_round=1, batch_size=2, correction="score_centering_sampled")
    trajs = _trajs_with_heads(2)
    with pytest.raises(ValueError, match="extra recorded draw"):
        train_round(model, build_optimizer(model, recipe, TrainerState()), trajs, np.array([1.0, -1.0]), [[0, 1]],
                    recipe, TrainerState(), 0, 0, progress=False)
    for t in trajs:
        for c in t.calls:
            c.extra_ids = list(reversed(c.output_ids))
    st = TrainerState()
    res = train_round(model, build_optimizer(model, recipe, st), trajs, np.array([1.0, -1.0]), [[0, 1]], recipe, st,
                      0, 0, progress=False)
    assert st.global_step == 1 and math.isfinite(res.steps[0]["loss"])


def test_settings_reject_nonsense_combinations():
    from pydantic import ValidationError

    from prodrl_pipelines.config.settings import DeploySettings, Settings

    with pytest.raises(ValidationError, match="record_extra_draw"):
        Settings(recipe=Recipe(correction="score_centering_sampled"))
    with pytest.raises(ValidationError, match="num_top_logprobs"):
        DeploySettings(top_k=20, num_top_logprobs=8)
    with pytest.raises(ValidationError, match="icepop_low"):
        Recipe(icepop_low=2.0, icepop_high=1.0)


def test_round_killed_mid_training_resumes_to_identical_weights(tmp_path):
    recipe = Recipe(steps_per_round=4, batch_size=2, learning_rate=1e-2, checkpoint_every=1, correction="tis")
    trajs = _trajs_with_heads(8, seed=3)
    adv = compute_advantages([t.reward for t in trajs], "loo")
    plan = [[0, 1], [2, 3], [4, 5], [6, 7]]

    def fresh():
        m = _tiny_model()
        st = TrainerState()
        return m, build_optimizer(m, recipe, st), st

    m_a, o_a, s_a = fresh()
    train_round(m_a, o_a, trajs, adv, plan, recipe, s_a, 0, 0, progress=False)

    class Killed(Exception):
        pass

    def die_after_third(step, metrics):
        if step == 3:
            raise Killed

    ckpt = tmp_path / "in-round.pt"
    m_b, o_b, s_b = fresh()
    with pytest.raises(Killed):
        train_round(m_b, o_b, trajs, adv, plan, recipe, s_b, 0, 0, progress=False, on_step=die_after_third,
                    resume_path=ckpt)
    assert ckpt.exists()
    m_c, o_c, s_c = fresh()  # the retried run starts again from theta_k
    res = train_round(m_c, o_c, trajs, adv, plan, recipe, s_c, 0, 0, progress=False, resume_path=ckpt)
    assert res.resumed_from_step == 2 and len(res.steps) == 4 and s_c.global_step == 4
    for (n, p), q in zip(m_a.named_parameters(), m_c.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=n)
    # a checkpoint of another plan is ignored, not applied
    m_d, o_d, s_d = fresh()
    res = train_round(m_d, o_d, trajs, adv, [[1, 0], [2, 3], [4, 5], [6, 7]], recipe, s_d, 0, 0, progress=False,
                      resume_path=ckpt)
    assert res.resumed_from_step == 0


def test_activation_checkpointing_gives_the_same_gradients():
    """The recipe's ``activation_checkpointing``: layers recomputed in backward, gradients unchanged."""
    from transformers import Qwen3MoeForCausalLM

    from prodrl_pipelines.lab.model import lab_model_config
    from prodrl_pipelines.rl.logprobs import policy_logprobs
    from prodrl_pipelines.rl.sharding import checkpoint_activations

    torch.manual_seed(0)
    grads = []
    for ac in (False, True):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(lab_model_config("tiny", vocab_size=64))
        if ac:
            checkpoint_activations(model)
        model.train()
        runs = []
        model.model.layers[0].self_attn.register_forward_pre_hook(lambda *a: runs.append(1))
        calls = [Call(list(range(1, 9)), [3, 4, 5], [-1.0, -1.0, -1.0], 1.0, [[3, 4], [4, 5], [5, 6]],
                      [[-1.0, -2.0]] * 3)]
        b = pack_minibatch([Trajectory("t", "", "v0", 1.0, calls)], np.ones(1), pad_id=0)
        policy_logprobs(model, b).sum().backward()
        assert len(runs) == (2 if ac else 1)  # recomputed in backward
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5, msg=n)
