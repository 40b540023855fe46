"""Turn recorded trajectories into padded training tensors (one row per model call).

Training uses the recorded ids of every call exactly as the engine consumed and sampled them; the
conversation is never re-rendered. Only model-generated tokens are trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from prodrl_pipelines.trajectories.schema import UNTRAINED_COLUMN


# Recorded head entries at or below this are padding (outside the processed support).
HEAD_FLOOR = -9000.0


@dataclass
class Call:
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    temperature: float
    top_ids: list[list[int]] | None = None  # recorded processed top-K head per generated position
    top_logprobs: list[list[float]] | None = None
    support_complete: bool = False
    top_k: int = 0
    top_p: float = 1.0
    extra_ids: list[int] | None = None  # recorded extra draw a' ~ mu per position (optional)
    trained: bool = True  # False: kept in the trajectory, but no token of it enters the objective

    def filtered(self, vocab_size: int | None = None) -> bool:
        """The deployment restricted the support (top-k / top-p): IS must renormalise over it. A
        top-k of at least the vocabulary keeps every token: no top-k."""
        top_k = self.top_k > 0 and (vocab_size is None or self.top_k < vocab_size)
        return top_k or self.top_p < 1.0


@dataclass
class Trajectory:
    trajectory_id: str
    task_id: str
    policy_version: str
    reward: float
    calls: list[Call] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        """T_i: model-generated tokens across the calls that are trained on."""
        return sum(len(c.output_ids) for c in self.calls if c.trained)


def trajectories_from_table(table: pa.Table) -> list[Trajectory]:
    """Group call rows (with a joined ``reward`` column) into trajectories ordered by call_index."""
    names = ["trajectory_id", "call_index", "task_id", "policy_version", "reward", "prompt_token_ids",
             "output_token_ids", "output_logprobs", "temperature", "top_token_ids", "top_logprobs",
             "support_complete", "top_k", "top_p"]
    for optional in ("extra_token_ids", UNTRAINED_COLUMN):
        if optional in table.column_names:
            names.append(optional)
    cols = table.select(names).to_pydict()
    extra = cols.get("extra_token_ids", [None] * table.num_rows)
    untrained = cols.get(UNTRAINED_COLUMN, [False] * table.num_rows)
    by_id: dict[str, Trajectory] = {}
    order = sorted(range(table.num_rows), key=lambda r: (cols["trajectory_id"][r], cols["call_index"][r]))
    for r in order:
        tid = cols["trajectory_id"][r]
        traj = by_id.get(tid)
        if traj is None:
            traj = by_id[tid] = Trajectory(tid, cols["task_id"][r] or "", cols["policy_version"][r], float(cols["reward"][r]))
        traj.calls.append(
            Call(cols["prompt_token_ids"][r], cols["output_token_ids"][r], cols["output_logprobs"][r],
                 float(cols["temperature"][r]), cols["top_token_ids"][r], cols["top_logprobs"][r],
                 bool(cols["support_complete"][r]), int(cols["top_k"][r] or 0), float(cols["top_p"][r] or 1.0),
                 extra[r], not untrained[r])
        )
    return sorted(by_id.values(), key=lambda t: t.trajectory_id)


@dataclass
class PackedBatch:
    """Right-padded calls of one minibatch; ``gen_*`` index the generated positions.

    Position p of ``input_ids`` predicts token p+1; the generated targets of row n sit at
    ``gen_pos`` (flattened pairs ``(gen_row, gen_pos)``) so the trainer only projects those
    hidden states onto the vocabulary.
    """

    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
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

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())


def pack_minibatch(trajs: list[Trajectory], advantages: np.ndarray, pad_id: int, total_batch: int | None = None,
                   vocab_size: int | None = None) -> PackedBatch:
    """Pack B trajectories; tokens get weight 1/(B*T_i) so J = (1/B) sum_i (1/T_i) sum_t ...

    ``total_batch``: B of the whole minibatch when this process packs only its shard of it
    (data parallel), so the ranks' partial objectives sum to the full one. ``vocab_size``: the
    policy's, so that a recorded top-k of at least the vocabulary counts as no top-k.
    """
    if len(trajs) != len(advantages):
        raise ValueError("one advantage per trajectory is required")
    B = total_batch or len(trajs)
    seqs, gen_row, gen_pos, targets, temps, lmu, adv, weight, tidx = [], [], [], [], [], [], [], [], []
    heads: list[tuple[Call, int]] = []
    for i, (tr, a) in enumerate(zip(trajs, advantages)):
        T = tr.num_generated
        if T == 0 and all(c.trained for c in tr.calls):
            raise ValueError(f"trajectory {tr.trajectory_id} has no generated tokens")
        for c in tr.calls:
            if not c.output_ids:
                continue
            row = len(seqs)
            seq = list(c.prompt_ids) + list(c.output_ids)
            seqs.append(seq[:-1])  # the last token is only a target
            P = len(c.prompt_ids)
            for t, tok in enumerate(c.output_ids):
                gen_row.append(row)
                gen_pos.append(P - 1 + t)
                targets.append(tok)
            n = len(c.output_ids)
            heads.append((c, n))
            temps += [c.temperature] * n
            lmu += list(c.output_logprobs)
            adv += [float(a)] * n
            weight += [1.0 / (B * T) if c.trained else 0.0] * n
            tidx += [i] * n
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    f32 = torch.float32
    tgt = torch.tensor(targets)
    K = max([len(r) for c, _ in heads for r in (c.top_ids or [])] or [1])
    G = len(targets)
    head_ids = tgt[:, None].repeat(1, K)
    head_mu = torch.full((G, K), float("-inf"))
    complete = torch.zeros(G, dtype=torch.bool)
    filtered = torch.zeros(G, dtype=torch.bool)
    extra_ids = tgt.clone()
    has_extra = torch.zeros(G, dtype=torch.bool)
    g = 0
    for c, n in heads:
        if c.extra_ids is not None:
            if len(c.extra_ids) != n:
                raise ValueError(f"extra_token_ids has {len(c.extra_ids)} ids for {n} generated tokens")
            extra_ids[g:g + n] = torch.tensor(c.extra_ids, dtype=torch.long)
            has_extra[g:g + n] = True
        if c.top_ids:
            for t in range(n):
                row_ids, row_lp = c.top_ids[t], c.top_logprobs[t]
                head_ids[g + t, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
                head_mu[g + t, : len(row_lp)] = torch.tensor(row_lp, dtype=f32)
        complete[g:g + n] = c.support_complete
        filtered[g:g + n] = c.filtered(vocab_size)
        g += n
    head_mask = head_mu > HEAD_FLOOR
    head_mu = head_mu.masked_fill(~head_mask, float("-inf"))
    in_head = ((head_ids == tgt[:, None]) & head_mask).any(-1)
    return PackedBatch(
        ids, mask, torch.tensor(gen_row), torch.tensor(gen_pos), tgt,
        torch.tensor(temps, dtype=f32), torch.tensor(lmu, dtype=f32), torch.tensor(adv, dtype=f32),
        torch.tensor(weight, dtype=f32), torch.tensor(tidx), head_ids, head_mu, head_mask, complete, filtered, in_head,
        extra_ids, has_extra,
    )
