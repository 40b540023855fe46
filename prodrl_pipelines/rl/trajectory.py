"""Recorded trajectories as the trainer sees them: calls with their recorded ids, logprobs and
sampling parameters, grouped by trajectory (from the round's dataset table)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from prodrl_pipelines.trajectories.routing import ROUTING_COLUMN, ROUTING_START_COLUMN, decode_routing
from prodrl_pipelines.trajectories.schema import UNTRAINED_COLUMN


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
    routing: np.ndarray | None = None  # MoE: recorded experts [positions, layers, k] from ``routing_start``
    routing_start: int = 0

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
    for optional in ("extra_token_ids", UNTRAINED_COLUMN, ROUTING_COLUMN, ROUTING_START_COLUMN):
        if optional in table.column_names:
            names.append(optional)
    cols = table.select(names).to_pydict()
    extra = cols.get("extra_token_ids", [None] * table.num_rows)
    untrained = cols.get(UNTRAINED_COLUMN, [False] * table.num_rows)
    routing = cols.get(ROUTING_COLUMN, [None] * table.num_rows)
    routing_start = cols.get(ROUTING_START_COLUMN, [None] * table.num_rows)
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
                 extra[r], not untrained[r],
                 None if routing[r] is None else decode_routing(routing[r]), int(routing_start[r] or 0))
        )
    return sorted(by_id.values(), key=lambda t: t.trajectory_id)
