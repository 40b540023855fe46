"""Trainer-side log-probabilities of the generated tokens, at the recorded temperature."""

from __future__ import annotations

import torch

from prodrl_pipelines.rl.batch import PackedBatch


def generated_hidden_states(model, batch: PackedBatch) -> torch.Tensor:
    """Final hidden states at the positions that predict generated tokens: [G, H].

    Only these rows are projected onto the vocabulary, so prompt positions never cost a
    [tokens x vocab] matmul.
    """
    out = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.last_hidden_state[batch.gen_row, batch.gen_pos]


def token_logprobs(model, batch: PackedBatch) -> torch.Tensor:
    """log pi(a|h) = log_softmax(z / tau)[a] for every generated token: [G]."""
    h = generated_hidden_states(model, batch)
    logits = model.lm_head(h).float() / batch.temperature.unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
