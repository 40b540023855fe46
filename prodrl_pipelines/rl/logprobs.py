"""Trainer-side log-probabilities of generated tokens and of the recorded head, computed in chunks.

Real vocabularies are ~150k, so [tokens x vocab] logits for a whole batch are never held at once:
``ChunkedGatherLogprobs`` projects ``chunk`` hidden states at a time, keeps only the gathered
log-probabilities and the log-sum-exp, and recomputes each chunk's logits in backward, where

    d logp[g, m] / d logits[g, :] = onehot(ids[g, m]) - softmax(logits[g, :])

so the gradient of ``sum_m grad[g, m] * logp[g, m]`` w.r.t. the logits is
``scatter(ids, grad) - (sum_m grad[g, m]) * softmax``. Peak extra memory: one chunk of logits.
"""

from __future__ import annotations

import torch
from torch import nn

from prodrl_pipelines.rl.batch import PackedBatch
from prodrl_pipelines.rl.routing_replay import RoutingStats, set_routing

DEFAULT_CHUNK = 1024


class ChunkedGatherLogprobs(torch.autograd.Function):
    """logp[g, m] = log_softmax(h[g] @ W^T / tau[g])[ids[g, m]], chunked over g.

    What keeps it within a few percent of four [chunk x V x H] matmuls per chunk (one forward, three
    backward: the recomputed logits, then d hidden and d W from one [chunk x V] buffer): 1/tau is
    folded into the chunk's hidden states (scaling [chunk x H] instead of [chunk x V]), every
    [chunk x V] step runs in place on the one logits buffer (no temporaries), and d W accumulates
    with ``addmm_`` into one fp32 buffer.
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, inv_temp, chunk: int):
        G = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least, fp64 stays fp64
        out = hidden.new_empty(ids.shape, dtype=acc)
        lse = hidden.new_empty(G, dtype=acc)
        inv_temp = inv_temp.to(hidden.dtype)
        for s in range(0, G, chunk):
            e = min(s + chunk, G)
            logits = ((hidden[s:e] * inv_temp[s:e, None]) @ weight.t()).to(acc)
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            out[s:e] = logits.gather(-1, ids[s:e]) - lse[s:e, None]
            del logits
        ctx.save_for_backward(hidden, weight, ids, inv_temp, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, ids, inv_temp, lse = ctx.saved_tensors
        chunk = ctx.chunk
        G = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = lse.dtype
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        for s in range(0, G, chunk):
            e = min(s + chunk, G)
            hs = hidden[s:e] * inv_temp[s:e, None]  # logits = hs @ W^T
            dlog = (hs @ weight.t()).to(acc)
            g = grad_out[s:e].to(acc)
            # d/dlogits = scatter(grad) - (sum grad) * softmax, in place on the recomputed logits
            dlog.sub_(lse[s:e, None]).exp_().mul_(-g.sum(-1, keepdim=True))
            dlog.scatter_add_(-1, ids[s:e], g)
            if need_h:
                grad_h[s:e] = (dlog.to(hidden.dtype) @ weight).mul_(inv_temp[s:e, None])
            if need_w:
                grad_w.addmm_(dlog.t(), hs.to(acc))
            del dlog
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None


def gather_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor,
                    chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Chunked log_softmax(h W^T / tau) gathered at ``ids`` [G, M]; exact gradients."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be [tokens, M], got shape {tuple(ids.shape)}")
    return ChunkedGatherLogprobs.apply(hidden, weight, ids, 1.0 / temperature.to(hidden.dtype), int(chunk))


def full_gather_logprobs(hidden, weight, ids, temperature) -> torch.Tensor:
    """Reference path: materialises all [tokens x vocab] logits (tests and benchmarks only)."""
    logits = (hidden @ weight.t()).float() / temperature.float()[:, None]
    return torch.log_softmax(logits, -1).gather(-1, ids)


def uses_flash_attention(config) -> bool:
    return (getattr(config, "_attn_implementation", None) or "").startswith("flash")


def packed_attention_mask(config, segment_ids: torch.Tensor) -> torch.Tensor | None:
    """The attention of rows of sequences packed back to back: causal within each sequence
    (``segment_ids`` [N, L]), never across. Flash-attention derives its variable-length boundaries
    from the restarting ``position_ids`` (no mask, as TRL's ``DataCollatorWithFlattening`` relies
    on); SDPA and eager need the 4D block-diagonal causal mask (position ids alone leave them
    attending across sequences), N x L^2 bytes."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if uses_flash_attention(config):
        return None
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"packed sequences need attn_implementation sdpa, eager or flash_attention_*, got {impl!r}")
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]).tril_()[:, None]
    if impl == "eager":  # eager adds the mask to the scores
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return mask


class PolicyLogprobs(nn.Module):
    """The trainer's log-prob computation as one module's forward: the decoder's final hidden states
    at the generated positions only (prompt positions cost no vocabulary matmul), projected on the
    vocabulary in chunks and gathered at ``ids``. FSDP2
    shards this module as its root, so the root's parameters (embeddings, final norm, lm_head) are
    gathered around exactly this computation."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    @property
    def config(self):
        return self.policy.config

    def forward(self, input_ids, attention_mask, gen_row, gen_pos, ids, temperature, chunk: int = DEFAULT_CHUNK,
                position_ids=None, segment_ids=None):
        from prodrl_pipelines.rl.lora import causal_lm

        lm = causal_lm(self.policy)
        if segment_ids is not None:  # packed sequences: attention never crosses a boundary
            attention_mask = packed_attention_mask(lm.config, segment_ids)
        out = lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        h = out.last_hidden_state[gen_row, gen_pos]
        return gather_logprobs(h, lm.lm_head.weight, ids, temperature, chunk)


def _gathered(model, batch: PackedBatch, ids: torch.Tensor, chunk: int, replay: bool | None = None,
              routing_stats: RoutingStats | None = None) -> torch.Tensor:
    """log pi at ``ids`` [G, M] for every generated position: through the model itself when it is a
    (sharded) ``PolicyLogprobs``, else through one wrapped around it. The batch's recorded MoE
    routing is installed for this forward (and the backward that follows it): replayed when
    ``replay`` (default: whenever the batch carries routing), else only compared into ``routing_stats``."""
    runner = model if isinstance(model, PolicyLogprobs) else PolicyLogprobs(model)
    replay = batch.routing is not None if replay is None else replay
    set_routing(runner.policy, batch.routing, batch.routing_known, routing_stats, replay=replay)
    return runner(batch.input_ids, batch.attention_mask, batch.gen_row, batch.gen_pos, ids, batch.temperature, chunk,
                  position_ids=batch.position_ids, segment_ids=batch.segment_ids)


def policy_logprobs(model, batch: PackedBatch, chunk: int = DEFAULT_CHUNK, replay: bool | None = None,
                    routing_stats: RoutingStats | None = None) -> torch.Tensor:
    """[G, 1+K+1]: column 0 = log pi(a|h) of the sampled token, columns 1..K = log pi over the
    recorded head ids (padding entries point at the sampled token; mask with ``batch.head_mask``),
    column K+1 = log pi(a') of the recorded extra draw (the sampled token where none was recorded).
    ``replay`` / ``routing_stats``: see ``_gathered``."""
    ids = torch.cat([batch.targets[:, None], batch.head_ids, batch.extra_ids[:, None]], dim=1)
    return _gathered(model, batch, ids, chunk, replay, routing_stats)


def token_logprobs(model, batch: PackedBatch, chunk: int = DEFAULT_CHUNK, replay: bool | None = None) -> torch.Tensor:
    """log pi(a|h) = log_softmax(z / tau)[a] for every generated token: [G]."""
    return _gathered(model, batch, batch.targets[:, None], chunk, replay)[:, 0]
