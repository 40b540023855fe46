"""Per-token policy-gradient terms j_{i,t}, one small named function per mismatch correction.

Chosen by name from the recipe (``POLICY_CORRECTIONS``), in the style of verl's ``core_algos``.
Every function returns the per-token objective ``j`` (maximised) and its diagnostics; the trainer
aggregates ``J = (1/B) sum_i (1/T_i) sum_t A_i * j_{i,t}`` and minimises ``-J + beta * KL``
(DESIGN.md section 4). sg() below is ``.detach()``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


class _TorchOnFirstUse:
    """``torch``, imported when a loss first runs: validating a recipe's names (settings, the CLI,
    Dagster's code servers and run workers) reads ``POLICY_CORRECTIONS`` without paying torch's import."""

    def __getattr__(self, name: str):
        real = importlib.import_module("torch")
        globals()["torch"] = real
        return getattr(real, name)


torch = _TorchOnFirstUse()


@dataclass(frozen=True)
class CorrectionParams:
    tis_cap: float = 2.0  # C
    ppo_eps: float = 0.2
    cis_lambda: float = 2.3
    cis_kappa: float = 5e-3
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    gspo_eps_low: float = 3e-4  # GSPO's sequence-ratio clip range [1 - low, 1 + high] (its paper's values)
    gspo_eps_high: float = 4e-4
    cispo_low: float = 0.0  # CISPO's IS-weight clip [low, high]
    cispo_high: float = 2.0
    seq_mis_low: float = 0.905  # seq_mis: keep a trajectory when its geometric-mean pi_k/mu is in [low, high]
    seq_mis_high: float = 1.105
    log_ratio_clamp: float = 20.0  # |log-ratio| cap before exp(), for numerical safety
    alpha_floor: float = 1e-6  # floor of 1 - P_H in the proportional-tail alpha


@dataclass
class TokenTerms:
    """Aligned per-token tensors of one minibatch (flattened over the generated tokens).

    logp:        log pi(a)    current trainer policy, carries gradients
    logp_old:    log pi_k(a)  round-start trainer policy (no grad), computed once per round
    logp_mu:     log mu(a)    recorded deployment logprob (processed)
    adv:         A_i broadcast to every generated token of trajectory i
    logp_is / logp_old_is: the same renormalised over the served support S when the deployment
                 used top-k/top-p (log pi(a) - log sum_{v in S} pi(v)); equal to logp otherwise
    head_logp:   [G, K] log pi(v) over the recorded head ids (carries gradients)
    head_mu:     [G, K] recorded log mu(v) over the head (-inf on padding)
    head_mask:   [G, K] real head entries
    support_complete: [G] the head holds the whole support (no tail)
    logp_ref:    log pi_ref(a), trainer forward with the deployed weights (``ref_is`` only)
    logp_extra:  log pi(a') of an extra recorded draw a' ~ mu (``score_centering_sampled`` only)
    seq:         [G] long, the trajectory of each token (sequence-level corrections)
    trained:     [G] bool, tokens of the objective (T_i counts these; context-only calls are not)
    """

    logp: torch.Tensor
    logp_old: torch.Tensor
    logp_mu: torch.Tensor
    adv: torch.Tensor
    logp_is: torch.Tensor | None = None
    logp_old_is: torch.Tensor | None = None
    head_logp: torch.Tensor | None = None
    head_mu: torch.Tensor | None = None
    head_mask: torch.Tensor | None = None
    support_complete: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None
    logp_extra: torch.Tensor | None = None
    seq: torch.Tensor | None = None
    trained: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.logp_is is None:
            self.logp_is = self.logp
        if self.logp_old_is is None:
            self.logp_old_is = self.logp_old


Diag = dict[str, float]
PolicyCorrection = Callable[[TokenTerms, CorrectionParams], "tuple[torch.Tensor, Diag]"]


def _exp_ratio(log_num: torch.Tensor, log_den: torch.Tensor, p: CorrectionParams) -> torch.Tensor:
    return (log_num - log_den).clamp(-p.log_ratio_clamp, p.log_ratio_clamp).exp()


def ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, eps: float) -> torch.Tensor:
    """clipPPO(r, A) = min(r*A, clip(r, 1-eps, 1+eps)*A) / A  (= r's pessimistic side for sign(A))."""
    clipped = ratio.clamp(1 - eps, 1 + eps)
    return torch.where(adv >= 0, torch.minimum(ratio, clipped), torch.maximum(ratio, clipped))


def _clip_frac(ratio: torch.Tensor, eps: float) -> float:
    return float(((ratio - 1).abs() > eps).float().mean())


def _weighted_ppo(t: TokenTerms, p: CorrectionParams, w: torch.Tensor, truncated: torch.Tensor) -> tuple[torch.Tensor, Diag]:
    """sg(w) * clipPPO(r, A) with r = pi_S(a) / pi_k,S(a) (both renormalised over the support)."""
    r = _exp_ratio(t.logp_is, t.logp_old_is.detach(), p)
    w = w.detach()
    diag = {"is_weight_mean": float(w.mean()), "is_weight_max": float(w.max()),
            "is_truncated_frac": float(truncated.float().mean()), "ppo_clip_frac": _clip_frac(r.detach(), p.ppo_eps)}
    return w * ppo_clip(r, t.adv, p.ppo_eps), diag


def none_correction(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """j = log pi(a): on-policy REINFORCE, ignores train-rollout mismatch."""
    return t.logp, {}


def tis_correction(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """j = sg(min(pi_k(a)/mu(a), C)) * clipPPO(pi(a)/pi_k(a), A): deployment TIS + PPO-clip."""
    k = _exp_ratio(t.logp_old_is, t.logp_mu, p)
    return _weighted_ppo(t, p, k.clamp(max=p.tis_cap), k > p.tis_cap)


def ref_is_correction(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """j = sg(min(pi_k(a)/pi_ref(a), C)) * clipPPO(r, A), pi_ref = trainer forward with the deployed
    (dequantised) weights: "reference-model IS", which cannot see engine mismatch."""
    if t.logp_ref is None:
        raise ValueError("correction 'ref_is' needs logp_ref (the deployed weights evaluated by the trainer)")
    k = _exp_ratio(t.logp_old_is, t.logp_ref, p)
    return _weighted_ppo(t, p, k.clamp(max=p.tis_cap), k > p.tis_cap)


def cis_weight(p_k: torch.Tensor, k: torch.Tensor, lam: float, kappa: float) -> torch.Tensor:
    """f = min(k, 1 + lambda * max(1 - p, kappa)): a ratio cap that tightens with confidence p."""
    return torch.minimum(k, 1 + lam * (1 - p_k).clamp(min=kappa))


def cis_correction(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """j = sg(f) * clipPPO(r, A), f = min(k, 1 + lambda*max(1 - p, kappa)), k = p/mu(a), p = pi_k(a)."""
    k = _exp_ratio(t.logp_old_is, t.logp_mu, p)
    f = cis_weight(t.logp_old_is.exp(), k, p.cis_lambda, p.cis_kappa)
    return _weighted_ppo(t, p, f, f < k)


def icepop_correction(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """j = sg(k * 1[lo <= k <= hi]) * clipPPO(r, A), k = pi_k(a)/mu(a): tokens outside the band are masked."""
    k = _exp_ratio(t.logp_old_is, t.logp_mu, p)
    inside = (k >= p.icepop_low) & (k <= p.icepop_high)
    return _weighted_ppo(t, p, k * inside, ~inside)


def proportional_tail_alpha(t: TokenTerms, p: CorrectionParams) -> torch.Tensor:
    """alpha = (1 - Q_H) / max(1 - P_H, floor), 0 when the head holds the whole support.

    Models the unrecorded tail of mu as proportional to pi: mu(v) = alpha * pi(v) for v not in H.
    """
    q_head = t.head_mu.exp().masked_fill(~t.head_mask, 0).sum(-1)
    p_head = t.head_logp.detach().exp().masked_fill(~t.head_mask, 0).sum(-1)
    alpha = (1 - q_head).clamp(min=0) / (1 - p_head).clamp(min=p.alpha_floor)
    return torch.where(t.support_complete, torch.zeros_like(alpha), alpha)


def score_centering(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """j = log pi(a) - sum_{v in H} sg(q_v - alpha * p_v) * log pi(v)  (w = 1).

    In logit space its gradient is e_a - mu (the score as if taken under the rollout policy) when
    the head is complete, or when the tail of mu really is proportional to pi.
    """
    if t.head_logp is None:
        raise ValueError("score_centering needs the recorded top-K head (top_token_ids/top_logprobs)")
    alpha = proportional_tail_alpha(t, p)
    q = t.head_mu.exp().masked_fill(~t.head_mask, 0)
    pv = t.head_logp.detach().exp().masked_fill(~t.head_mask, 0)
    coef = (q - alpha[:, None] * pv).detach()
    center = (coef * t.head_logp.masked_fill(~t.head_mask, 0)).sum(-1)
    return t.logp - center, {"sc_alpha_mean": float(alpha.mean()), "sc_head_mass_mu": float(q.sum(-1).mean())}


def score_centering_sampled(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """j = log pi(a) - log pi(a'), a' an extra independent draw from mu recorded per position."""
    if t.logp_extra is None:
        raise ValueError("score_centering_sampled needs an extra recorded draw per position (extra_token_ids)")
    return t.logp - t.logp_extra, {}


def sequence_mean(x: torch.Tensor, t: TokenTerms) -> torch.Tensor:
    """Per token, the mean of ``x`` over the trained tokens of its trajectory: (1/T_i) sum_t x_{i,t}."""
    if t.seq is None:
        raise ValueError("a sequence-level correction needs each token's trajectory (TokenTerms.seq)")
    w = (t.trained if t.trained is not None else torch.ones_like(t.seq, dtype=torch.bool)).to(x.dtype)
    n = int(t.seq.max()) + 1 if t.seq.numel() else 0
    total = x.new_zeros(n).index_add(0, t.seq, x * w)
    count = x.new_zeros(n).index_add(0, t.seq, w).clamp(min=1)
    return (total / count)[t.seq]


def gspo_correction(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """GSPO: j = clipPPO(s_i, A) at every token of trajectory i, with the sequence ratio
    s_i = exp((1/T_i) sum_t log(pi_S(a_t) / pi_k,S(a_t))) clipped to [1 - eps_low, 1 + eps_high].

    With the trainer's token weights 1/(B*T_i) this is GSPO's objective (1/B) sum_i A_i clipPPO(s_i);
    grad s_i = s_i * (1/T_i) sum_t grad log pi(a_t): one length-normalised ratio per trajectory, so a
    single token's noise (an MoE routing flip) moves it by 1/T_i of its log-ratio, not by the ratio."""
    s = sequence_mean(t.logp_is - t.logp_old_is.detach(), t).clamp(-p.log_ratio_clamp, p.log_ratio_clamp).exp()
    clipped = s.clamp(1 - p.gspo_eps_low, 1 + p.gspo_eps_high)
    j = torch.where(t.adv >= 0, torch.minimum(s, clipped), torch.maximum(s, clipped))
    out = ((s.detach() < 1 - p.gspo_eps_low) | (s.detach() > 1 + p.gspo_eps_high)).float().mean()
    return j, {"seq_ratio_mean": float(s.detach().mean()), "seq_clip_frac": float(out)}


def cispo_correction(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """CISPO: j = sg(clip(r, low, high)) * log pi(a), r = pi_S(a) / mu(a): the REINFORCE score of every
    token, weighted by its clipped importance weight with the gradient stopped, so no token's
    gradient is ever dropped (PPO's clip zeroes it) and none is weighted above ``high``."""
    r = _exp_ratio(t.logp_is.detach(), t.logp_mu, p)
    w = r.clamp(p.cispo_low, p.cispo_high)
    return w * t.logp, {"is_weight_mean": float(w.mean()), "is_weight_max": float(w.max()),
                        "is_truncated_frac": float(((r < p.cispo_low) | (r > p.cispo_high)).float().mean())}


def seq_mis_correction(t: TokenTerms, p: CorrectionParams) -> tuple[torch.Tensor, Diag]:
    """Sequence-level masked IS (verl's ``seq-mis`` / geometric ``geo_rs``): j = 1[lo <= g_i <= hi] *
    clipPPO(pi_S(a)/pi_k,S(a), A), g_i = exp((1/T_i) sum_t log(pi_k,S(a_t) / mu(a_t))) the geometric
    mean of trajectory i's deployment ratios: a trajectory the deployment sampled too differently
    (a routing flip, a broken kernel) is rejected whole instead of being trained on token by token."""
    g = sequence_mean((t.logp_old_is - t.logp_mu).detach(), t).clamp(-p.log_ratio_clamp, p.log_ratio_clamp).exp()
    keep = (g >= p.seq_mis_low) & (g <= p.seq_mis_high)
    j, diag = _weighted_ppo(t, p, keep.to(t.logp.dtype), ~keep)
    return j, {**diag, "seq_rejected_frac": float((~keep).float().mean()), "seq_geo_ratio_mean": float(g.mean())}


SEQUENCE_LEVEL = frozenset({"gspo", "seq_mis"})  # corrections that need a trajectory's tokens together

POLICY_CORRECTIONS: dict[str, PolicyCorrection] = {
    "none": none_correction,
    "tis": tis_correction,
    "ref_is": ref_is_correction,
    "cis": cis_correction,
    "icepop": icepop_correction,
    "score_centering": score_centering,
    "score_centering_sampled": score_centering_sampled,
    "gspo": gspo_correction,
    "cispo": cispo_correction,
    "seq_mis": seq_mis_correction,
}


def sampled_kl(logp: torch.Tensor, logp_old: torch.Tensor, logp_mu: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """kl = rho * (exp(x) - 1 - x), x = log pi_k(a) - log pi(a), rho = exp(log pi(a) - log mu(a)).

    rho is not detached. Under a ~ mu with full support, E[kl] = KL(pi || pi_k) and E[grad kl] =
    grad KL(pi || pi_k); with top-k/top-p serving it is biased (as the seed notes).
    """
    x = (logp_old.detach() - logp).clamp(-clamp, clamp)
    rho = (logp - logp_mu).clamp(-clamp, clamp).exp()
    return rho * (torch.expm1(x) - x)


def policy_objective(
    terms: TokenTerms, token_weight: torch.Tensor, correction: str, params: CorrectionParams | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """J = sum_t token_weight_t * A_t * j_t with token_weight = 1/(B * T_i).

    Returns the scalar objective (to maximise) and the correction's diagnostics.
    """
    j, diag = POLICY_CORRECTIONS[correction](terms, params or CorrectionParams())
    return (token_weight * terms.adv * j).sum(), diag


def kl_penalty(terms: TokenTerms, token_weight: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """(1/B) sum_i (1/T_i) sum_t kl_{i,t}: the same aggregation as the objective."""
    return (token_weight * sampled_kl(terms.logp, terms.logp_old, terms.logp_mu, clamp)).sum()
