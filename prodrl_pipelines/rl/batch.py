"""Turn recorded trajectories into training tensors: padded rows, or packed rows without padding.

Training uses the recorded ids of every call exactly as the engine consumed and sampled them; the
conversation is never re-rendered. Only model-generated tokens are trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from prodrl_pipelines.rl.sequences import Sequence, minibatch_sequences
from prodrl_pipelines.rl.trajectory import Trajectory



# Recorded head entries at or below this are padding (outside the processed support).
HEAD_FLOOR = -9000.0
# Packed rows may pad up to this fraction of a micro-batch's tokens; beyond it, one row.
MAX_ROW_PADDING = 0.05


@dataclass
class PackedBatch:
    """The input rows of some training sequences and, flattened, their generated positions.

    Two layouts of the same per-token data: ``padded`` (one right-padded row per sequence, a 2D
    ``attention_mask``) and ``packed`` (sequences back to back in rows: ``position_ids`` restart at
    each sequence and ``segment_ids`` bound the block-diagonal causal attention, so no token attends
    across a sequence boundary; the row's tail, if any, is one segment of padding). Position p of a
    row predicts token p+1; the generated targets sit at ``(gen_row, gen_pos)`` so the trainer only
    projects those hidden states onto the vocabulary.
    """

    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor | None  # [N, L] long (padded); None (packed: built from segment_ids)
    gen_row: torch.Tensor  # [G] long
    gen_pos: torch.Tensor  # [G] long, position whose logits predict the target
    targets: torch.Tensor  # [G] long
    temperature: torch.Tensor  # [G] float
    logp_mu: torch.Tensor  # [G] float, recorded processed log mu(a)
    adv: torch.Tensor  # [G] float, A_i of the token's trajectory
    weight: torch.Tensor  # [G] float, 1 / (B * T_i)
    traj_index: torch.Tensor  # [G] long, trajectory index within the minibatch
    head_ids: torch.Tensor  # [G, K] long, recorded processed top-K ids (padding -> the sampled id)
    head_mu: torch.Tensor  # [G, K] float, recorded log mu over the head (padding -> -inf)
    head_mask: torch.Tensor  # [G, K] bool, real head entries inside the processed support
    support_complete: torch.Tensor  # [G] bool, the head holds the whole sampling support
    filtered: torch.Tensor  # [G] bool, served with top-k/top-p (IS renormalises over the support)
    target_in_head: torch.Tensor  # [G] bool
    extra_ids: torch.Tensor  # [G] long, recorded extra draw a' (the sampled id where none was recorded)
    has_extra: torch.Tensor  # [G] bool
    position_ids: torch.Tensor | None = None  # [N, L] long (packed)
    segment_ids: torch.Tensor | None = None  # [N, L] long, the sequence of each position (packed)
    routing: torch.Tensor | None = None  # [N, L, layers, k] long, recorded MoE experts per input position
    routing_known: torch.Tensor | None = None  # [N, L] bool, positions with a recording
    filler: bool = False  # a zero-weight stand-in that keeps the ranks' collectives in step

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def num_inputs(self) -> int:
        """Positions the model computes (padding included)."""
        return int(self.input_ids.numel())

    def to(self, device) -> "PackedBatch":
        """The same batch with every tensor on ``device`` (the model's)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        return PackedBatch(**moved)


def _head_rows(rows: list[list], n: int, K: int, fill, dtype) -> np.ndarray:
    """A call's recorded head as an [n, K] array (short rows padded with ``fill``)."""
    if rows and all(len(r) == K for r in rows):
        return np.asarray(rows, dtype=dtype).reshape(n, K)
    out = np.full((n, K), fill, dtype=dtype)
    for t, r in enumerate(rows):
        out[t, :len(r)] = r
    return out


def first_fit_decreasing(lengths: list[int], capacity: int, order: list[int] | None = None) -> list[list[int]]:
    """Indices of ``lengths`` in bins of at most ``capacity`` (an item larger than that alone),
    longest first, each into the first bin with room."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if order is None else order
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def balanced_rows(lengths: list[int], n_rows: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``n_rows`` rows of near-equal total: longest first, each into the
    row with the least so far."""
    import heapq

    heap = [(0, r) for r in range(max(1, n_rows))]
    rows: list[list[int]] = [[] for _ in heap]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        rows[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return [r for r in rows if r]


def pack_sequences(seqs: list[Sequence], pad_id: int, vocab_size: int | None = None,
                   layout: str = "packed", one_row: bool = False, with_routing: bool = False) -> PackedBatch:
    """The tensors of ``seqs`` in ``layout``: ``padded`` (a right-padded row each) or ``packed``.

    Packed sequences fill rows of near-equal length (``balanced_rows``) about as long as the
    longest sequence, or twice, four times that..., the first that pads at most
    ``MAX_ROW_PADDING`` of the tokens: a dense
    block-diagonal mask then costs rows x row^2 instead of total^2 (many short sequences). Failing
    that (a few sequences of unequal length), or with ``one_row`` (flash-attention's
    variable-length path has no quadratic mask), they go into one row without any padding.
    ``with_routing``: also lay out the calls' recorded MoE routing (``Sequence.routing``)."""
    if layout not in ("packed", "padded"):
        raise ValueError(f"unknown layout {layout!r}; known: ['packed', 'padded']")
    if not seqs:
        raise ValueError("no sequences to pack")
    spans = [(r, sp) for r, s in enumerate(seqs) for sp in s.spans if sp.call.output_ids]
    K = max([len(row) for _, sp in spans for row in (sp.call.top_ids or [])] or [1])
    lens = [s.num_inputs for s in seqs]
    if layout == "packed":
        bins, cap = [list(range(len(seqs)))], max(lens)
        while not one_row and cap < sum(lens):  # the shortest rows that pad little
            rows = balanced_rows(lens, sum(lens) // cap)
            if len(rows) * max(sum(lens[i] for i in r) for r in rows) <= (1 + MAX_ROW_PADDING) * sum(lens):
                bins = rows
                break
            cap *= 2
    else:
        bins = [[i] for i in range(len(seqs))]
    where = {}  # sequence -> (row, offset)
    for r, members in enumerate(bins):
        off = 0
        for i in members:
            where[i] = (r, off)
            off += lens[i]
    gen_row, gen_pos, targets, temps, lmu, adv, weight, tidx = [], [], [], [], [], [], [], []
    head_ids, head_mu, complete, filtered, extra, has_extra = [], [], [], [], [], []
    for r, sp in spans:
        c, n = sp.call, len(sp.call.output_ids)
        tgt = np.asarray(c.output_ids, dtype=np.int64)
        row, off = where[r]
        gen_row.append(np.full(n, row, dtype=np.int64))
        gen_pos.append(np.arange(off + sp.start - 1, off + sp.start - 1 + n, dtype=np.int64))
        targets.append(tgt)
        temps.append(np.full(n, c.temperature, dtype=np.float32))
        lmu.append(np.asarray(c.output_logprobs, dtype=np.float32))
        adv.append(np.full(n, sp.adv, dtype=np.float32))
        weight.append(np.full(n, sp.weight, dtype=np.float32))
        tidx.append(np.full(n, sp.traj, dtype=np.int64))
        if c.top_ids:
            ids = _head_rows(c.top_ids, n, K, -1, np.int64)
            head_ids.append(np.where(ids < 0, tgt[:, None], ids))
            head_mu.append(_head_rows(c.top_logprobs, n, K, -np.inf, np.float32))
        else:
            head_ids.append(np.repeat(tgt[:, None], K, axis=1))
            head_mu.append(np.full((n, K), -np.inf, dtype=np.float32))
        complete.append(np.full(n, c.support_complete))
        filtered.append(np.full(n, c.filtered(vocab_size)))
        if c.extra_ids is not None:
            if len(c.extra_ids) != n:
                raise ValueError(f"extra_token_ids has {len(c.extra_ids)} ids for {n} generated tokens")
            extra.append(np.asarray(c.extra_ids, dtype=np.int64))
        else:
            extra.append(tgt)
        has_extra.append(np.full(n, c.extra_ids is not None))

    L = max(sum(lens[i] for i in members) for members in bins)
    ids = torch.full((len(bins), L), pad_id, dtype=torch.long)
    mask = position_ids = segment_ids = None
    if layout == "packed":
        position_ids = torch.zeros((len(bins), L), dtype=torch.long)
        segment_ids = torch.full((len(bins), L), len(seqs), dtype=torch.long)  # the tail: one padding segment
    else:
        mask = torch.zeros((len(bins), L), dtype=torch.long)
    for i, seq in enumerate(seqs):
        row, off = where[i]
        ids[row, off:off + lens[i]] = torch.tensor(seq.ids[:-1], dtype=torch.long)  # the last token is only a target
        if layout == "packed":
            position_ids[row, off:off + lens[i]] = torch.arange(lens[i])
            segment_ids[row, off:off + lens[i]] = i
        else:
            mask[row, :lens[i]] = 1
    if layout == "packed":  # positions of the padding tail count on from 0
        tail = segment_ids == len(seqs)
        position_ids[tail] = (tail.cumsum(1) - 1)[tail]
    routing = routing_known = None
    if with_routing:
        routing, routing_known = _routing_rows(seqs, where, lens, len(bins), L)

    def cat(parts):
        return torch.from_numpy(np.concatenate(parts))

    tgt = cat(targets)
    hmu = cat(head_mu)
    hids = cat(head_ids)
    head_mask = hmu > HEAD_FLOOR
    hmu = hmu.masked_fill(~head_mask, float("-inf"))
    in_head = ((hids == tgt[:, None]) & head_mask).any(-1)
    return PackedBatch(
        ids, mask, cat(gen_row), cat(gen_pos), tgt, cat(temps), cat(lmu), cat(adv), cat(weight), cat(tidx),
        hids, hmu, head_mask, cat(complete), cat(filtered), in_head, cat(extra), cat(has_extra),
        position_ids=position_ids, segment_ids=segment_ids, routing=routing, routing_known=routing_known,
    )


def _routing_rows(seqs: list[Sequence], where: dict, lens: list[int], n_rows: int, L: int):
    """[rows, L, layers, k] recorded experts at each input position and [rows, L] which have one;
    (None, None) when no sequence recorded routing."""
    per_seq = [s.routing() for s in seqs]
    shapes = {r[0].shape[1:] for r in per_seq if r is not None}
    if not shapes:
        return None, None
    if len(shapes) > 1:
        raise ValueError(f"sequences of one micro-batch recorded routing of different shapes {sorted(shapes)}")
    (shape,) = shapes
    routing = np.zeros((n_rows, L, *shape), dtype=np.int64)
    known = np.zeros((n_rows, L), dtype=bool)
    for i, r in enumerate(per_seq):
        if r is not None:
            row, off = where[i]
            routing[row, off:off + lens[i]] = r[0]
            known[row, off:off + lens[i]] = r[1]
    return torch.from_numpy(routing), torch.from_numpy(known)


def pack_minibatch(trajs: list[Trajectory], advantages: np.ndarray, pad_id: int, total_batch: int | None = None,
                   vocab_size: int | None = None, with_routing: bool = False) -> PackedBatch:
    """Pack B trajectories; tokens get weight 1/(B*T_i) so J = (1/B) sum_i (1/T_i) sum_t ...

    One right-padded row per model call: the simple layout of tests and scripts, and the reference
    the trainer's packed, merged micro-batches are checked against.
    ``total_batch``: B of the whole minibatch when this process packs only its shard of it
    (data parallel), so the ranks' partial objectives sum to the full one. ``vocab_size``: the
    policy's, so that a recorded top-k of at least the vocabulary counts as no top-k.
    """
    return pack_sequences(minibatch_sequences(trajs, advantages, total_batch, merge=False), pad_id, vocab_size,
                          layout="padded", with_routing=with_routing)
