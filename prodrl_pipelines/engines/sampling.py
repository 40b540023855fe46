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
  When the cut falls inside a group of exactly equal probabilities, which members are kept depends
  on the sort order (as in vLLM); their values, and the support size, do not.
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
    *,
    candidates: int = 1024,
) -> Tensor:
    """Log-probabilities of the served sampling distribution, shape ``[..., V]`` like ``logits``.

    ``temperature``, ``top_k`` and ``top_p`` are scalars or tensors with one value per row (shape
    ``logits.shape[:-1]``). Computation is in fp32 (or fp64 when given fp64 logits).

    With filtering on, rows whose support provably lies within their ``candidates`` most likely
    tokens are computed from a ``topk`` of that size instead of a full sort of the vocabulary (a
    full sort of 64 x 152k logits takes ~1.5 s on one CPU core, a top-1024 ~0.1 s); the others
    (top-p cut beyond the candidates, or top-k ties straddling them) try 16x more candidates, then
    fall back to the full sort. All paths compute the same distribution.
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

    if _top_k_off(top_k, vocab) and _top_p_off(top_p):
        return torch.log_softmax(x, dim=-1)

    k = _as_row_param(top_k, batch_shape, torch.long, x.device)
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)  # vocab = off
    p = _as_row_param(top_p, batch_shape, compute_dtype, x.device)

    flat_x, flat_k, flat_p = x.reshape(-1, vocab), k.reshape(-1), p.reshape(-1)
    k_on = flat_k < vocab
    n_cand = max(int(candidates), int(flat_k[k_on].max()) + 1 if bool(k_on.any()) else 1)
    out = torch.empty_like(flat_x)
    todo: Tensor | None = None  # rows not settled yet; None = all rows
    while n_cand < vocab:
        rows = slice(None) if todo is None else todo
        part, ok = _filter_via_candidates(flat_x[rows], flat_k[rows], flat_p[rows], n_cand)
        if todo is None and bool(ok.all()):
            return part.reshape(x.shape)
        done = ok.nonzero().squeeze(-1)
        left = (~ok).nonzero().squeeze(-1)
        idx = done if todo is None else todo[done]
        out[idx] = part[done]
        todo = left if todo is None else todo[left]
        if todo.numel() == 0:
            return out.reshape(x.shape)
        n_cand *= 16  # a wider tier before the full sort
    rows = slice(None) if todo is None else todo
    out[rows] = _filter_via_sort(flat_x[rows], flat_k[rows], flat_p[rows])
    return out.reshape(x.shape)


def _filter_via_sort(x: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """Reference path on [N, V] rows: one ascending sort serves both filters (vLLM's algorithm).

    Top-p works from the low end like vLLM: drop a token when the mass at or below it is <= 1 - top_p.
    That is "the mass above it is >= top_p", but it cannot drop tail tokens when top_p = 1 even if a
    descending cumulative sum rounds to 1 early.
    """
    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=False)
    kth = sorted_x.gather(-1, (vocab - k).unsqueeze(-1))  # [N, 1]: the k-th largest
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    mass_at_or_below = torch.cumsum(torch.softmax(sorted_x, dim=-1), dim=-1)
    drop = mass_at_or_below <= (1 - p).unsqueeze(-1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.log_softmax(filtered, dim=-1)


def _filter_via_candidates(x: Tensor, k: Tensor, p: Tensor, n_cand: int) -> tuple[Tensor, Tensor]:
    """Fast path on [N, V] rows from the top ``n_cand`` logits; ``ok`` marks the rows it settles."""
    vocab = x.shape[-1]
    neg_inf = float("-inf")
    vals, ids = torch.topk(x, n_cand, dim=-1, largest=True, sorted=True)  # descending
    k_on = k < vocab
    p_on = p < 1
    kth = vals.gather(-1, (k.clamp(max=n_cand) - 1).unsqueeze(-1)).squeeze(-1)
    kth = torch.where(k_on, kth, torch.full_like(kth, neg_inf))
    keep = vals >= kth.unsqueeze(-1)
    # Top-k ties that reach the last candidate may continue outside the candidates.
    ok = ~(k_on & (kth <= vals[:, -1]))
    # Normaliser of the top-k-filtered distribution: the kept candidates when top-k is on, else the
    # whole vocabulary (then the mass outside the candidates is the tail).
    lse_k = torch.logsumexp(vals.masked_fill(~keep, neg_inf), dim=-1)
    if not bool(k_on.all()):  # a full pass over the vocabulary only when needed
        top = vals[:, :1]  # the row max: skips the max pass of torch.logsumexp
        lse_full = (x - top).exp_().sum(-1).log_() + top.squeeze(-1)
        lse_k = torch.where(k_on, lse_k, lse_full)
    probs = torch.exp(vals - lse_k.unsqueeze(-1)).masked_fill(~keep, 0.0)
    tail = torch.where(k_on, torch.zeros_like(lse_k), (1 - probs.sum(-1)).clamp(min=0))
    mass_at_or_below = torch.flip(torch.cumsum(torch.flip(probs, [-1]), dim=-1), [-1]) + tail.unsqueeze(-1)
    drop = mass_at_or_below <= (1 - p).unsqueeze(-1)
    drop[:, 0] = False  # always keep the most likely token
    # Without top-k, top-p must have cut inside the candidates (then everything after is cut too).
    ok &= k_on | (p_on & drop[:, -1])
    kept = vals.masked_fill(~keep | drop, neg_inf)
    kept = kept - torch.logsumexp(kept, dim=-1, keepdim=True)
    out = torch.full_like(x, neg_inf).scatter_(-1, ids, kept)
    return out, ok


def support_size(processed: Tensor) -> Tensor:
    """Number of tokens with non-zero processed probability, per row (shape ``[...]``)."""
    return (processed != float("-inf")).sum(dim=-1)


def top_logprobs(processed: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` most likely tokens of each processed row.

    Returns ``(ids [..., k], logprobs [..., k], support_complete [...])`` with rows sorted by
    descending logprob (``-inf`` entries fill the row when the support is smaller than ``k``), and
    ``support_complete`` true where the support has at most ``k`` tokens, i.e. the head holds every
    token that can be sampled.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    vocab = processed.shape[-1]
    # The (k+1)-th largest entry tells whether the support fits in k tokens, without a full count.
    values, ids = torch.topk(processed, min(k + 1, vocab), dim=-1, largest=True, sorted=True)
    if vocab > k:
        complete = values[..., k] == float("-inf")
        values, ids = values[..., :k], ids[..., :k]
    else:  # vocabulary smaller than k: pad so rows always have length k
        complete = torch.ones(values.shape[:-1], dtype=torch.bool, device=values.device)
        pad = k - vocab
        values = torch.cat([values, values.new_full((*values.shape[:-1], pad), float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_zeros((*ids.shape[:-1], pad))], dim=-1)
    return ids, values, complete
