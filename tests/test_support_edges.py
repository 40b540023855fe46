"""Edge cases of the IS support (DESIGN.md s.4): a top-k of at least the vocabulary is no top-k; an
incomplete head estimates sum_S pi as sum_H pi / Q_H; a retokenized call whose support is unknown is
not trained on (counted). With deployment == trainer every IS ratio must be exactly 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prodrl_pipelines.engines.sampling import processed_logprobs
from prodrl_pipelines.rl.trajectory import Call, Trajectory
from prodrl_pipelines.rl.batch import pack_minibatch
from prodrl_pipelines.rl.trainer import support_renormalised

V, K = 64, 6


def _batch(logits: torch.Tensor, targets: list[int], top_k: int = 0, top_p: float = 1.0, vocab: int | None = V):
    """One call sampling ``targets`` from the processed distribution of ``logits`` [T, V] (the
    deployment == the trainer), with the recorded top-K head; and the trainer's [G, 1+K] log pi."""
    mu = processed_logprobs(logits, top_k=top_k, top_p=top_p)  # log mu over the vocabulary, -inf outside S
    head_lp, head_ids = mu.topk(K, dim=-1)
    head_lp = head_lp.clamp(min=-9999.0)
    complete = bool(torch.isfinite(mu).sum(-1).le(K).all())
    call = Call(prompt_ids=[1], output_ids=targets, output_logprobs=[float(mu[t, a]) for t, a in enumerate(targets)],
                temperature=1.0, top_ids=head_ids.tolist(), top_logprobs=head_lp.tolist(), support_complete=complete,
                top_k=top_k, top_p=top_p)
    b = pack_minibatch([Trajectory("t", "", "v0", 1.0, [call])], np.ones(1), pad_id=0, vocab_size=vocab)
    pi = torch.log_softmax(logits, -1)  # the trainer's unfiltered log pi
    lp_all = torch.cat([pi.gather(-1, b.targets[:, None]), pi.gather(-1, b.head_ids)], dim=-1)
    return b, lp_all


def _head_mass(lp_all: torch.Tensor, b) -> torch.Tensor:
    """The old estimate of log sum_S pi: the head (plus the sampled token) alone."""
    return torch.logsumexp(torch.cat([lp_all[:, 1:].masked_fill(~b.head_mask, -torch.inf),
                                      lp_all[:, :1].masked_fill(b.target_in_head[:, None], -torch.inf)], -1), -1)


@pytest.mark.parametrize("top_k", [V, V + 10, 10**6])
def test_a_top_k_of_at_least_the_vocabulary_is_no_top_k(top_k):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(8, V, generator=g)
    targets = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(-1).tolist()
    b, lp_all = _batch(logits, targets, top_k=top_k)
    assert not bool(b.filtered.any())
    assert torch.allclose(support_renormalised(lp_all, b), b.logp_mu, atol=1e-5)  # ratio 1: pi == mu
    assert Call([1], [2], [0.0], 1.0, top_k=top_k).filtered(V) is False
    assert Call([1], [2], [0.0], 1.0, top_k=V - 1).filtered(V) is True


@pytest.mark.parametrize("seed", range(5))
def test_an_incomplete_head_estimates_the_support_mass_exactly_when_pi_is_mu(seed):
    """top-p keeps more tokens than the head holds: sum_S pi = sum_H pi / Q_H when pi is proportional
    to mu on S (here pi == mu up to the renormalisation), whichever tokens were sampled, in the head
    or not; the head alone underestimated it, so the IS ratio pi_S/mu came out above 1."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(32, V, generator=g) * 0.7  # flat: the top-0.95 support holds far more than K
    mu = processed_logprobs(logits, top_p=0.95)
    targets = torch.multinomial(mu.exp(), 1, generator=g).squeeze(-1).tolist()
    b, lp_all = _batch(logits, targets, top_p=0.95)
    assert not bool(b.support_complete.any()) and bool(b.filtered.all())
    assert (~b.target_in_head).any() and b.target_in_head.any()  # both cases occur
    got = support_renormalised(lp_all, b)
    assert torch.allclose(got, b.logp_mu, atol=1e-5), (got - b.logp_mu).abs().max()
    head_only = lp_all[:, 0] - _head_mass(lp_all, b)
    assert (head_only - b.logp_mu).min() > 1e-3  # the old estimate: too large everywhere


def test_a_complete_head_is_the_exact_support():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(16, V, generator=g) * 3
    mu = processed_logprobs(logits, top_k=4)
    targets = torch.multinomial(mu.exp(), 1, generator=g).squeeze(-1).tolist()
    b, lp_all = _batch(logits, targets, top_k=4)
    assert bool(b.support_complete.all())
    assert torch.allclose(support_renormalised(lp_all, b), b.logp_mu, atol=1e-6)
    # and with pi != mu the estimate is the exact renormalisation over S, not a model of it
    pi = torch.log_softmax(logits + torch.randn(16, V, generator=g), -1)
    lp2 = torch.cat([pi.gather(-1, b.targets[:, None]), pi.gather(-1, b.head_ids)], dim=-1)
    S = torch.isfinite(mu)
    exact = pi.gather(-1, b.targets[:, None]).squeeze(-1) - torch.logsumexp(pi.masked_fill(~S, -torch.inf), -1)
    assert torch.allclose(support_renormalised(lp2, b), exact, atol=1e-5)


def test_the_support_estimate_beats_the_head_alone_when_pi_moved_away_from_mu():
    """Monte Carlo over random perturbations: pi no longer proportional to mu on S. The estimate's
    error in log sum_S pi is smaller than the head-alone's on average."""
    g = torch.Generator().manual_seed(11)
    errs_new, errs_old = [], []
    for _ in range(20):
        logits = torch.randn(16, V, generator=g) * 0.7
        mu = processed_logprobs(logits, top_p=0.9)
        targets = torch.multinomial(mu.exp(), 1, generator=g).squeeze(-1).tolist()
        b, _ = _batch(logits, targets, top_p=0.9)
        pi = torch.log_softmax(logits + 0.3 * torch.randn(16, V, generator=g), -1)
        lp = torch.cat([pi.gather(-1, b.targets[:, None]), pi.gather(-1, b.head_ids)], dim=-1)
        S = torch.isfinite(mu)
        true = torch.logsumexp(pi.masked_fill(~S, -torch.inf), -1)
        new = lp[:, 0] - support_renormalised(lp, b)
        old = _head_mass(lp, b)
        errs_new.append((new - true).abs().mean())
        errs_old.append((old - true).abs().mean())
    assert float(torch.stack(errs_new).mean()) < 0.5 * float(torch.stack(errs_old).mean())


def test_an_untrained_call_stays_in_its_trajectory_with_no_weight():
    a = Call([1, 2], [3, 4], [-1.0, -1.0], 1.0)
    b = Call([1, 2, 3, 4, 5], [6, 7, 8], [-1.0] * 3, 1.0, trained=False)
    c = Call([1], [9], [-1.0], 1.0)
    batch = pack_minibatch([Trajectory("t", "", "v0", 1.0, [a, b, c])], np.ones(1), pad_id=0)
    assert batch.weight.tolist() == pytest.approx([1 / 3, 1 / 3, 0, 0, 0, 1 / 3])  # T_i counts trained tokens
    only = pack_minibatch([Trajectory("u", "", "v0", 1.0, [b])], np.ones(1), pad_id=0)
    assert float(only.weight.sum()) == 0.0  # a trajectory of untrained calls contributes nothing
