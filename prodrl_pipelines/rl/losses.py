"""Per-token policy-gradient terms j_{i,t}, one small named function per mismatch correction.

Chosen by name from the recipe (``POLICY_CORRECTIONS``), in the style of verl's ``core_algos``.
Every function returns the per-token objective ``j`` (maximised); the trainer aggregates
``J = (1/B) sum_i (1/T_i) sum_t A_i * j_{i,t}`` and minimises ``-J`` (DESIGN.md section 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class TokenTerms:
    """Aligned per-token tensors of one minibatch (flattened over the generated tokens).

    logp:     log pi(a)   current trainer policy, carries gradients
    logp_old: log pi_k(a) round-start trainer policy (no grad), computed once per round
    logp_mu:  log mu(a)   recorded deployment logprob (processed)
    adv:      A_i broadcast to every generated token of trajectory i
    """

    logp: torch.Tensor
    logp_old: torch.Tensor
    logp_mu: torch.Tensor
    adv: torch.Tensor


PolicyCorrection = Callable[[TokenTerms], tuple[torch.Tensor, dict[str, float]]]


def none_correction(t: TokenTerms) -> tuple[torch.Tensor, dict[str, float]]:
    """j = log pi(a): on-policy REINFORCE, ignores train-rollout mismatch."""
    return t.logp, {}


POLICY_CORRECTIONS: dict[str, PolicyCorrection] = {
    "none": none_correction,
}


def policy_objective(
    terms: TokenTerms, token_weight: torch.Tensor, correction: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """J = sum_t token_weight_t * A_t * j_t with token_weight = 1/(B * T_i).

    Returns the scalar objective (to maximise) and the correction's diagnostics.
    """
    j, diag = POLICY_CORRECTIONS[correction](terms)
    return (token_weight * terms.adv * j).sum(), diag
