"""Mismatch corrections, score centering, KL and chunked log-probs against closed forms and Monte Carlo."""

import math
from types import SimpleNamespace

import pytest
import torch

from prodrl_pipelines.rl.logprobs import full_gather_logprobs, gather_logprobs
from prodrl_pipelines.rl.losses import (
    POLICY_CORRECTIONS, CorrectionParams, TokenTerms, cis_weight, policy_objective, ppo_clip, sampled_kl,
)
from prodrl_pipelines.rl.trainer import support_renormalised

P = CorrectionParams()
log = math.log


def _t(logp, logp_old, logp_mu, adv, **kw):
    f = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return TokenTerms(f(logp).requires_grad_(), f(logp_old), f(logp_mu), f(adv), **kw)


# --- hand-computed values ---------------------------------------------------------------------
def test_ppo_clip_takes_the_pessimistic_side():
    r = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0])
    a = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    assert ppo_clip(r, a, 0.2).tolist() == pytest.approx([1.2, 1.5, 0.5, 0.8, 1.0])


def test_tis_hand_computed():
    # k = pi_k/mu = .5/.2 = 2.5 -> capped at C = 2; r = pi/pi_k = .75/.5 = 1.5
    t = _t([log(0.75)] * 2, [log(0.5)] * 2, [log(0.2)] * 2, [1.0, -1.0])
    j, d = POLICY_CORRECTIONS["tis"](t, P)
    assert j.tolist() == pytest.approx([2 * 1.2, 2 * 1.5])
    assert d["is_truncated_frac"] == 1.0 and d["ppo_clip_frac"] == 1.0
    # gradient: only the unclipped (A < 0) token carries one: d(2 * r)/d logp = 2 * r = 3
    j.sum().backward()
    assert t.logp.grad.tolist() == pytest.approx([0.0, 3.0])


def test_tis_at_round_start_is_weighted_reinforce():
    t = _t([log(0.4)], [log(0.4)], [log(0.5)], [2.0])
    J, _ = policy_objective(t, torch.ones(1, dtype=torch.float64), "tis")
    J.backward()
    assert t.logp.grad.item() == pytest.approx(0.8 * 2.0)  # sg(k) * A * dlog pi


def test_ref_is_uses_reference_not_mu():
    t = _t([log(0.5)], [log(0.5)], [log(0.01)], [1.0], logp_ref=torch.tensor([log(0.4)], dtype=torch.float64))
    j, _ = POLICY_CORRECTIONS["ref_is"](t, P)
    assert j.item() == pytest.approx(0.5 / 0.4)
    with pytest.raises(ValueError, match="logp_ref"):
        POLICY_CORRECTIONS["ref_is"](_t([0.0], [0.0], [0.0], [1.0]), P)


def test_icepop_band():
    t = _t([log(0.5)] * 3, [log(0.5)] * 3, [log(0.2), log(0.4), log(0.9)], [1.0] * 3)
    j, d = POLICY_CORRECTIONS["icepop"](t, P)
    assert j.tolist() == pytest.approx([0.0, 1.25, 0.5 / 0.9])
    assert d["is_truncated_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("p, k, expected", [
    (0.5, 1.5, 1.5),  # below the cap 1 + 2.3 * 0.5 = 2.15
    (0.5, 3.0, 2.15),  # above: capped
    (0.999, 1.05, 1 + 2.3 * 5e-3),  # confident token: the kappa floor binds
    (0.2, 0.3, 0.3),  # the lower side is never truncated
])
def test_cis_weight_boundaries(p, k, expected):
    assert cis_weight(torch.tensor(p), torch.tensor(k), 2.3, 5e-3).item() == pytest.approx(expected)


def test_cis_ratio_is_shift_in_log_odds():
    # k = p/q = p + (1 - p) e^eps with eps = logit p - logit q (the paper's decomposition)
    g = torch.Generator().manual_seed(0)
    p, q = torch.rand(100, generator=g, dtype=torch.float64), torch.rand(100, generator=g, dtype=torch.float64)
    eps = torch.logit(p) - torch.logit(q)
    torch.testing.assert_close(p / q, p + (1 - p) * torch.exp(eps))
    # threshold in log-odds: f < k exactly when e^eps > 1 + lambda (above the floor)
    k = p / q
    f = cis_weight(p, k, 2.3, 0.0)
    torch.testing.assert_close(f < k, torch.exp(eps) > 1 + 2.3)


def test_cis_correction_matches_formula():
    t = _t([log(0.5)], [log(0.5)], [log(0.1)], [1.0])
    j, _ = POLICY_CORRECTIONS["cis"](t, P)
    assert j.item() == pytest.approx(min(5.0, 1 + 2.3 * 0.5))


# --- score centering --------------------------------------------------------------------------
def _softmax_setup(V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    mu = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    A = torch.randn(V, generator=g, dtype=torch.float64)
    return z, mu, A


def _sc_terms(z, mu_head, head_ids, complete):
    """One row per possible sampled token a (G = V), the same context and head."""
    V = z.shape[0]
    lp = torch.log_softmax(z, -1)
    K = len(head_ids)
    return TokenTerms(
        logp=lp, logp_old=lp.detach(), logp_mu=torch.zeros(V, dtype=torch.float64), adv=torch.ones(V, dtype=torch.float64),
        head_logp=lp[head_ids].expand(V, K), head_mu=torch.log(mu_head).expand(V, K),
        head_mask=torch.ones(V, K, dtype=torch.bool), support_complete=torch.full((V,), complete),
    )


def test_score_centering_complete_head_gives_rollout_score():
    z, mu, A = _softmax_setup()
    V = z.shape[0]
    t = _sc_terms(z, mu, torch.arange(V), True)
    j, _ = POLICY_CORRECTIONS["score_centering"](t, P)
    for a in range(V):
        (g,) = torch.autograd.grad(j[a], z, retain_graph=True)
        torch.testing.assert_close(g, torch.eye(V, dtype=torch.float64)[a] - mu)  # e_a - mu
    # expected update under the sampler: sum_a mu(a) A(a) grad j(a) = sum_v mu(v) A(v) (e_v - mu)
    (g,) = torch.autograd.grad((mu * A * j).sum(), z)
    analytic = sum(mu[v] * A[v] * (torch.eye(V, dtype=torch.float64)[v] - mu) for v in range(V))
    torch.testing.assert_close(g, analytic)
    # the plain score is biased ("drift") when pi != mu
    plain = torch.autograd.grad((mu * A * torch.log_softmax(z, -1)).sum(), z)[0]
    assert not torch.allclose(plain, analytic, atol=1e-3)


def test_score_centering_proportional_tail_is_exact_when_tail_is_proportional():
    z, _, A = _softmax_setup(V=7, seed=1)
    V = z.shape[0]
    pi = torch.softmax(z, -1).detach()
    head = torch.tensor([0, 2, 5])
    q_head = torch.tensor([0.3, 0.25, 0.2], dtype=torch.float64)
    alpha = (1 - q_head.sum()) / (1 - pi[head].sum())
    mu = alpha * pi
    mu[head] = q_head  # the tail of mu is proportional to pi
    t = _sc_terms(z, q_head, head, False)
    j, d = POLICY_CORRECTIONS["score_centering"](t, P)
    assert d["sc_alpha_mean"] == pytest.approx(float(alpha))
    for a in range(V):
        (g,) = torch.autograd.grad(j[a], z, retain_graph=True)
        torch.testing.assert_close(g, torch.eye(V, dtype=torch.float64)[a] - mu)


def test_score_centering_sampled_monte_carlo():
    z, mu, A = _softmax_setup(V=5, seed=2)
    V = z.shape[0]
    g = torch.Generator().manual_seed(3)
    N = 200_000
    a = torch.multinomial(mu, N, replacement=True, generator=g)
    a2 = torch.multinomial(mu, N, replacement=True, generator=g)
    lp = torch.log_softmax(z, -1)
    t = TokenTerms(lp[a], lp[a].detach(), torch.zeros(N, dtype=torch.float64), A[a], logp_extra=lp[a2])
    J, _ = policy_objective(t, torch.full((N,), 1.0 / N, dtype=torch.float64), "score_centering_sampled")
    (grad,) = torch.autograd.grad(J, z)
    analytic = sum(mu[v] * A[v] * (torch.eye(V, dtype=torch.float64)[v] - mu) for v in range(V))
    assert (grad - analytic).abs().max() < 0.01


# --- KL -------------------------------------------------------------------------------------------
def test_sampled_kl_value_and_gradient_monte_carlo():
    g = torch.Generator().manual_seed(0)
    V, N = 6, 400_000
    z = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    zk = z.detach() + 0.5 * torch.randn(V, generator=g, dtype=torch.float64)
    mu = torch.softmax(z.detach() + 0.3 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    a = torch.multinomial(mu, N, replacement=True, generator=g)
    lp, lpk = torch.log_softmax(z, -1), torch.log_softmax(zk, -1)
    est = sampled_kl(lp[a], lpk[a], torch.log(mu)[a]).mean()
    exact = (lp.exp() * (lp - lpk)).sum()
    assert est.item() == pytest.approx(exact.item(), rel=0.03)
    g_est = torch.autograd.grad(est, z, retain_graph=True)[0]
    g_exact = torch.autograd.grad(exact, z)[0]
    assert (g_est - g_exact).abs().max() < 0.03 * g_exact.abs().max() + 2e-3


def test_kl_is_zero_at_reference_and_clamped():
    lp = torch.tensor([-1.0, -2.0])
    assert sampled_kl(lp, lp, lp - 0.1).abs().max() == 0
    assert torch.isfinite(sampled_kl(torch.tensor([-200.0]), torch.tensor([-0.1]), torch.tensor([-0.1]))).all()


# --- renormalisation -----------------------------------------------------------------------------
def test_is_ratio_under_top_k_is_ratio_of_renormalised_probs():
    from prodrl_pipelines.engines.sampling import processed_logprobs

    g = torch.Generator().manual_seed(0)
    V, K = 12, 5
    z_mu = torch.randn(V, generator=g, dtype=torch.float64)
    z_k = z_mu + 0.2 * torch.randn(V, generator=g, dtype=torch.float64)
    proc = processed_logprobs(z_mu[None], temperature=1.0, top_k=4)[0]
    head = torch.topk(proc, K).indices  # K >= top_k: the head holds the whole support
    support = torch.isfinite(proc)
    for a in support.nonzero().flatten().tolist():
        lp_k = torch.log_softmax(z_k, -1)
        lp_all = torch.cat([lp_k[a:a + 1], lp_k[head]])[None]
        b = SimpleNamespace(head_mask=torch.isfinite(proc[head])[None], target_in_head=torch.tensor([True]),
                            filtered=torch.tensor([True]), head_mu=proc[head][None], logp_mu=proc[a:a + 1],
                            support_complete=torch.tensor([True]))
        got = support_renormalised(lp_all, b)[0] - proc[a]
        pk_s = lp_k.exp()[support]
        expected = torch.log(lp_k.exp()[a] / pk_s.sum()) - proc[a]
        torch.testing.assert_close(got, expected)
    # unfiltered serving: no renormalisation
    b = SimpleNamespace(head_mask=torch.ones(1, K, dtype=torch.bool), target_in_head=torch.tensor([True]),
                        filtered=torch.tensor([False]), head_mu=proc[head][None], logp_mu=proc[:1],
                        support_complete=torch.tensor([False]))
    assert support_renormalised(lp_all, b)[0] == lp_all[0, 0]


# --- chunked log-probs ---------------------------------------------------------------------------
def test_chunked_logprobs_gradcheck():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (5, 3), generator=g)
    tau = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: gather_logprobs(h, w, ids, tau, chunk=2), (h, w))


def test_chunked_matches_full_path():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(300, 32, generator=g, requires_grad=True)
    w = torch.randn(1000, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, 1000, (300, 9), generator=g)
    tau = torch.rand(300, generator=g) + 0.5
    coef = torch.randn(300, 9, generator=g)
    a = gather_logprobs(h, w, ids, tau, chunk=64)
    (a * coef).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    b = full_gather_logprobs(h, w, ids, tau)
    (b * coef).sum().backward()
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gh, h.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gw, w.grad, atol=1e-4, rtol=1e-4)
