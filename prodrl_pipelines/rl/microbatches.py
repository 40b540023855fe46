"""Token-budget micro-batches: a minibatch's sequences split over the ranks and into packed rows.

One Adam step per minibatch, as before; its gradient is accumulated over micro-batches of at most
``max_tokens_per_microbatch`` input positions each (per process), so peak memory follows the budget,
not the minibatch size or its longest call. The objective is a sum over generated tokens with
weights 1/(B*T_i), so any partition of the sequences gives the same step.

- Ranks (data parallel): sequences go longest first to the rank with the fewest tokens so far, so
  the ranks' work is balanced by tokens, not by trajectory count. Every rank then runs the same
  number of micro-batches (FSDP2 gathers parameters in every forward): a rank with fewer gets
  zero-weight fillers.
- Within a rank: first-fit decreasing, so micro-batches fill the budget. A sequence longer than the
  budget cannot be cut (its positions attend to each other) and gets a micro-batch of its own; so
  does a group (``groups``: a trajectory under a sequence-level correction) longer than the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from prodrl_pipelines.rl.trajectory import Call
from prodrl_pipelines.rl.batch import PackedBatch, first_fit_decreasing, pack_sequences
from prodrl_pipelines.rl.sequences import Sequence, Span


@dataclass
class MicroBatchPlan:
    """``ranks[r][m]``: indices of the sequences in micro-batch m of rank r ([] = a filler)."""

    ranks: list[list[list[int]]]
    oversize: int  # sequences (with ``groups``: groups) longer than the budget, each alone in its micro-batch

    @property
    def num_micro(self) -> int:
        return len(self.ranks[0])


def plan_microbatches(lengths: list[int], budget: int, world_size: int = 1,
                      groups: list[int] | None = None) -> MicroBatchPlan:
    """Deterministic micro-batches of sequences with ``lengths`` input positions each; with
    ``groups`` (a key per sequence), the sequences of one group always share a micro-batch."""
    if budget < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {budget}")
    if groups is not None:
        keys = list(dict.fromkeys(groups))
        members = [[i for i, g in enumerate(groups) if g == k] for k in keys]
        plan = plan_microbatches([sum(lengths[i] for i in m) for m in members], budget, world_size)
        ranks = [[[i for gi in mb for i in members[gi]] for mb in r] for r in plan.ranks]
        return MicroBatchPlan(ranks, plan.oversize)  # a group over the budget is what cannot be split
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    load = [0] * world_size
    mine: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        mine[r].append(i)
        load[r] += lengths[i]
    ranks = [first_fit_decreasing(lengths, budget, order=m) for m in mine]
    n = max(1, max(len(r) for r in ranks))
    for r in ranks:
        r.extend([] for _ in range(n - len(r)))
    return MicroBatchPlan(ranks, sum(1 for x in lengths if x > budget))


def filler_batch(pad_id: int) -> PackedBatch:
    """One two-token sequence with zero weight: the forward and backward a rank without work of its
    own runs so that the ranks' collectives stay in step; it changes no gradient."""
    call = Call([pad_id], [pad_id], [0.0], 1.0, extra_ids=[pad_id], trained=False)
    b = pack_sequences([Sequence([pad_id, pad_id], [Span(call, 1, 0.0, 0.0, 0)])], pad_id)
    b.filler = True
    return b


def pack_micro(seqs: list[Sequence], idx: list[int], pad_id: int, vocab_size: int | None,
               one_row: bool = False, with_routing: bool = False) -> PackedBatch:
    """Micro-batch ``idx`` of ``seqs`` packed (a filler when ``idx`` is empty); ``one_row`` for
    flash-attention, ``with_routing`` for routing replay (see ``pack_sequences``)."""
    if not idx:
        return filler_batch(pad_id)
    return pack_sequences([seqs[i] for i in idx], pad_id, vocab_size, layout="packed", one_row=one_row,
                          with_routing=with_routing)
