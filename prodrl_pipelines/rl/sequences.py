"""The calls of a trajectory as training sequences: one sequence per run of calls whose prompts extend.

A multi-turn episode recorded call by call repeats its history in every prompt: call j+1's prompt
ids usually start with call j's prompt + output ids (the *extension property*), followed by the
tokens between the calls (tool results, the next user turn). Training each call as its own row
recomputes every prefix (7-23x the unique tokens on agent traffic). Here the calls that extend one
another become one sequence (the last call's prompt + output) in which each call's output positions
keep their own recorded mu, head, temperature and support, and the tokens between them are context
only. Causal attention makes the merged sequence compute exactly what the separate calls computed.

Where the property breaks (a template that drops earlier reasoning or re-serialises a tool call, a
harness that edits or truncates history) the call starts a new sequence; nothing is re-tokenised and
nothing is guessed. Each break is counted with its reason (``SPLIT_REASONS``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from prodrl_pipelines.rl.trajectory import Call, Trajectory

# Why a call could not extend the sequence before it.
SPLIT_REASONS = {
    # the prompt keeps the previous prompt but not the model's own output as sampled: the template or
    # the harness re-rendered it (earlier reasoning dropped, a tool call re-serialised)
    "output_rewritten": "the prompt repeats the previous prompt but not the previous output's ids",
    # the prompt does not even start with the previous prompt: history edited, truncated or summarised
    "history_edited": "the prompt does not start with the previous call's prompt",
}


@dataclass
class Span:
    """One call's generated tokens inside a sequence: output token t sits at position ``start + t``."""

    call: Call
    start: int
    adv: float
    weight: float  # 1 / (B * T_i) for a trained call, 0 for context-only calls
    traj: int  # the trajectory's index within the minibatch


@dataclass
class Sequence:
    """Token ids ``ids`` (the last merged call's prompt + output) and the calls trained inside it;
    ``calls``: every call merged into it, in order (their recorded MoE routing covers its positions)."""

    ids: list[int]
    spans: list[Span] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    @property
    def num_inputs(self) -> int:
        """Positions fed to the model: the last token is only a target."""
        return len(self.ids) - 1

    def routing(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The recorded experts of every input position, [num_inputs, layers, k], and which positions
        have one ([num_inputs] bool); None when no call of the sequence recorded routing.

        Each position takes the routing of the earliest call that forwarded it: a later call's prompt
        repeats the earlier calls' tokens, but the log-probs of those tokens were computed (and their
        keys and values cached) when the earlier call ran."""
        recorded = [c for c in (self.calls or [sp.call for sp in self.spans]) if c.routing is not None]
        if not recorded:
            return None
        shape = recorded[0].routing.shape[1:]
        n = self.num_inputs
        out = np.zeros((n, *shape), dtype=np.int64)
        known = np.zeros(n, dtype=bool)
        for c in recorded:
            if c.routing.shape[1:] != shape:
                raise ValueError(f"calls of one sequence recorded routing of shapes {shape} and {c.routing.shape[1:]}")
            lo = c.routing_start
            hi = min(n, lo + c.routing.shape[0])
            fresh = ~known[lo:hi]
            out[lo:hi][fresh] = c.routing[:hi - lo][fresh]
            known[lo:hi] = True
        return out, known


@dataclass
class LayoutStats:
    """What merging did to a set of trajectories (summed over a round's minibatches)."""

    calls: int = 0  # calls with generated tokens
    merged_calls: int = 0  # calls trained inside the sequence of an earlier call
    split_calls: Counter = field(default_factory=Counter)  # reason -> calls that started a new sequence
    sequences: int = 0
    sequence_tokens: int = 0  # positions of the merged sequences (what the trainer computes)
    per_call_tokens: int = 0  # positions of one row per call (what per-call rows would compute)
    micro_batches: int = 0  # per rank, summed over the minibatches
    oversize_sequences: int = 0  # sequences (trajectories, when kept whole) longer than the micro-batch budget

    def as_metrics(self) -> dict[str, float]:
        out = {"layout_calls": self.calls, "layout_merged_calls": self.merged_calls,
               "layout_split_calls": sum(self.split_calls.values()), "layout_sequences": self.sequences,
               "layout_sequence_tokens": self.sequence_tokens, "layout_per_call_tokens": self.per_call_tokens,
               "layout_micro_batches": self.micro_batches, "layout_oversize_sequences": self.oversize_sequences,
               "layout_tokens_saved_frac": 1 - self.sequence_tokens / self.per_call_tokens if self.per_call_tokens else 0.0}
        out.update({f"layout_split_{r}": self.split_calls.get(r, 0) for r in SPLIT_REASONS})
        return out


def _starts_with(ids: list[int], prefix: list[int]) -> bool:
    return len(ids) >= len(prefix) and ids[:len(prefix)] == prefix


def split_reason(prev: Call, nxt: Call) -> str | None:
    """None when ``nxt``'s prompt extends ``prev``'s prompt + output ids, else why it does not."""
    prompt, out = list(prev.prompt_ids), list(prev.output_ids)
    if not _starts_with(list(nxt.prompt_ids), prompt):
        return "history_edited"
    if list(nxt.prompt_ids[len(prompt):len(prompt) + len(out)]) != out:
        return "output_rewritten"
    return None


def trajectory_sequences(traj: Trajectory, adv: float, total_batch: int, index: int, merge: bool = True,
                         stats: LayoutStats | None = None) -> list[Sequence]:
    """The sequences of one trajectory; ``merge=False`` gives one sequence per call (the per-call layout).

    Calls without generated tokens add nothing to train but still carry the history forward: a call
    that extends them joins the same sequence. Sequences with no generated token are dropped.
    """
    T = traj.num_generated
    if T == 0 and all(c.trained for c in traj.calls):
        raise ValueError(f"trajectory {traj.trajectory_id} has no generated tokens")
    stats = stats if stats is not None else LayoutStats()
    seqs: list[Sequence] = []
    prev: Call | None = None
    for c in traj.calls:
        n_out = len(c.output_ids)
        reason = None if prev is None or not merge else split_reason(prev, c)
        if merge and prev is not None and reason is None:
            seq = seqs[-1]
            seq.ids = list(c.prompt_ids) + list(c.output_ids)
            seq.calls.append(c)
            if n_out:
                stats.merged_calls += 1
        else:
            if n_out and prev is not None and reason is not None and seqs and seqs[-1].spans:
                stats.split_calls[reason] += 1
            seq = Sequence(list(c.prompt_ids) + list(c.output_ids), calls=[c])
            seqs.append(seq)
        if n_out:
            stats.calls += 1
            stats.per_call_tokens += len(c.prompt_ids) + n_out - 1
            seq.spans.append(Span(c, len(c.prompt_ids), float(adv), 1.0 / (total_batch * T) if c.trained else 0.0, index))
        prev = c
    kept = [s for s in seqs if s.spans]
    stats.sequences += len(kept)
    stats.sequence_tokens += sum(s.num_inputs for s in kept)
    return kept


def minibatch_sequences(trajs: list[Trajectory], advantages, total_batch: int | None = None, merge: bool = True,
                        stats: LayoutStats | None = None) -> list[Sequence]:
    """Every sequence of a minibatch of B trajectories, token weights 1/(B*T_i) (``total_batch``: B of
    the whole minibatch when only a part of it is laid out here)."""
    if len(trajs) != len(advantages):
        raise ValueError("one advantage per trajectory is required")
    B = total_batch or len(trajs)
    out: list[Sequence] = []
    for i, (tr, a) in enumerate(zip(trajs, advantages)):
        out += trajectory_sequences(tr, a, B, i, merge, stats)
    return out
