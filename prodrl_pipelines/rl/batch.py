"""Turn recorded trajectories into padded training tensors (one row per model call).

Training uses the recorded ids of every call exactly as the engine consumed and sampled them; the
conversation is never re-rendered. Only model-generated tokens are trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch


@dataclass
class Call:
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    temperature: float


@dataclass
class Trajectory:
    trajectory_id: str
    task_id: str
    policy_version: str
    reward: float
    calls: list[Call] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        """T_i: model-generated tokens across all calls."""
        return sum(len(c.output_ids) for c in self.calls)


def trajectories_from_table(table: pa.Table) -> list[Trajectory]:
    """Group call rows (with a joined ``reward`` column) into trajectories ordered by call_index."""
    cols = table.select(
        ["trajectory_id", "call_index", "task_id", "policy_version", "reward", "prompt_token_ids",
         "output_token_ids", "output_logprobs", "temperature"]
    ).to_pydict()
    by_id: dict[str, Trajectory] = {}
    order = sorted(range(table.num_rows), key=lambda r: (cols["trajectory_id"][r], cols["call_index"][r]))
    for r in order:
        tid = cols["trajectory_id"][r]
        traj = by_id.get(tid)
        if traj is None:
            traj = by_id[tid] = Trajectory(tid, cols["task_id"][r] or "", cols["policy_version"][r], float(cols["reward"][r]))
        traj.calls.append(
            Call(cols["prompt_token_ids"][r], cols["output_token_ids"][r], cols["output_logprobs"][r],
                 float(cols["temperature"][r]))
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

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())


def pack_minibatch(trajs: list[Trajectory], advantages: np.ndarray, pad_id: int) -> PackedBatch:
    """Pack B trajectories; tokens get weight 1/(B*T_i) so J = (1/B) sum_i (1/T_i) sum_t ..."""
    if len(trajs) != len(advantages):
        raise ValueError("one advantage per trajectory is required")
    B = len(trajs)
    seqs, gen_row, gen_pos, targets, temps, lmu, adv, weight, tidx = [], [], [], [], [], [], [], [], []
    for i, (tr, a) in enumerate(zip(trajs, advantages)):
        T = tr.num_generated
        if T == 0:
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
            temps += [c.temperature] * n
            lmu += list(c.output_logprobs)
            adv += [float(a)] * n
            weight += [1.0 / (B * T)] * n
            tidx += [i] * n
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    f32 = torch.float32
    return PackedBatch(
        ids, mask, torch.tensor(gen_row), torch.tensor(gen_pos), torch.tensor(targets),
        torch.tensor(temps, dtype=f32), torch.tensor(lmu, dtype=f32), torch.tensor(adv, dtype=f32),
        torch.tensor(weight, dtype=f32), torch.tensor(tidx),
    )
