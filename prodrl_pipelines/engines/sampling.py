"""Processed sampling distributions, as served (DESIGN.md sections 3 and 7).

``processed_logprobs`` reproduces vLLM's ``--logprobs-mode processed_logprobs``: the log-softmax of
``logits / temperature`` after top-k and then top-p filtering, filtered tokens at ``-inf`` and the
kept support renormalised. These are the ``log mu(a|h)`` values the trainer's corrections use.

Conventions (same as vLLM's sampler):

* top-k keeps every token whose scaled logit is >= the k-th largest one (ties at the threshold are
  kept, so the support can exceed k only on exact ties); ``top_k = 0`` (or >= vocab) is off.
* top-p works on the top-k-renormalised probabilities and keeps the smallest prefix of the
  descending order whose cumulative probability reaches ``top_p`` (a token is kept iff the mass
  strictly above it is < top_p); the most likely token is always kept; ``top_p = 1`` is off.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["processed_logprobs", "top_logprobs", "support_size"]

Param = float | int | Tensor


def _as_row_param(value: Param, batch_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Broadcast a scalar or per-row parameter to ``batch_shape`` (one value per distribution)."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    return t.expand(batch_shape) if t.dim() == 0 else t.reshape(batch_shape)


def _top_k_off(top_k: Param, vocab: int) -> bool:
    t = torch.as_tensor(top_k)
    return bool(((t <= 0) | (t >= vocab)).all())


def _top_p_off(top_p: Param) -> bool:
    return bool((torch.as_tensor(top_p) >= 1.0).all())


def processed_logprobs(
    logits: Tensor,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
) -> Tensor:
    """Log-probabilities of the served sampling distribution, shape ``[..., V]`` like ``logits``.

    ``temperature``, ``top_k`` and ``top_p`` are scalars or tensors with one value per row (shape
    ``logits.shape[:-1]``). Computation is in fp32 (or fp64 when given fp64 logits).
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute_dtype)
    batch_shape = x.shape[:-1]
    vocab = x.shape[-1]

    temp = _as_row_param(temperature, batch_shape, compute_dtype, x.device)
    if bool((temp <= 0).any()):
        raise ValueError("temperature must be > 0")
    x = x / temp.unsqueeze(-1)

    k_off = _top_k_off(top_k, vocab)
    p_off = _top_p_off(top_p)
    if k_off and p_off:
        return torch.log_softmax(x, dim=-1)

    # One ascending sort serves both filters (masking the top-k tail keeps the order valid). Top-p
    # works from the low end like vLLM: drop a token when the mass at or below it is <= 1 - top_p.
    # That is "the mass above it is >= top_p", but it cannot drop tail tokens when top_p = 1 even if
    # a descending cumulative sum rounds to 1 early.
    sorted_x, order = torch.sort(x, dim=-1, descending=False)
    if not k_off:
        k = _as_row_param(top_k, batch_shape, torch.long, x.device)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        kth = sorted_x.gather(-1, (vocab - k).unsqueeze(-1))  # [..., 1]: the k-th largest
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if not p_off:
        p = _as_row_param(top_p, batch_shape, compute_dtype, x.device)
        mass_at_or_below = torch.cumsum(torch.softmax(sorted_x, dim=-1), dim=-1)
        drop = mass_at_or_below <= (1 - p).unsqueeze(-1)
        drop[..., -1] = False  # always keep the most likely token
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.log_softmax(filtered, dim=-1)


def support_size(processed: Tensor) -> Tensor:
    """Number of tokens with non-zero processed probability, per row (shape ``[...]``)."""
    return torch.isfinite(processed).sum(dim=-1)


def top_logprobs(processed: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` most likely tokens of each processed row.

    Returns ``(ids [..., k], logprobs [..., k], support_complete [...])`` with rows sorted by
    descending logprob (``-inf`` entries fill the row when the support is smaller than ``k``), and
    ``support_complete`` true where the support has at most ``k`` tokens, i.e. the head holds every
    token that can be sampled.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k_eff = min(k, processed.shape[-1])
    values, ids = torch.topk(processed, k_eff, dim=-1, largest=True, sorted=True)
    if k_eff < k:  # vocabulary smaller than k: pad so rows always have length k
        pad = k - k_eff
        values = torch.cat([values, values.new_full((*values.shape[:-1], pad), float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_zeros((*ids.shape[:-1], pad))], dim=-1)
    return ids, values, support_size(processed) <= k
