"""The pi_k pass's figures of a round, the same on every rank: |log pi_k - log mu| over the round's
tokens and, for an MoE policy with recorded routing, how often the recorded expert sets differ from
the trainer's own and the mismatch with and without replay.

The with/without-replay pair costs one extra forward, run on the round's first micro-batches until
``ROUTING_DIAGNOSTIC_TOKENS`` generated tokens with recorded routing are sampled. Under FSDP2 every
forward gathers the parameters collectively, so a forward on one rank only leaves the ranks'
all-gathers out of step (a deadlock). The extra forward is therefore decided for all ranks at once
(``RoundDiagnostics.due``: one small all-reduce of [ranks that want it, tokens sampled]): a rank
whose micro-batch is a filler, or has no recorded routing, runs it too and drops the result. At the
end the figures are summed and gathered over the ranks, so every rank reports the round's, as one
process does (exactly its figures when the sample covers the round).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from prodrl_pipelines.rl.batch import PackedBatch
from prodrl_pipelines.rl.routing_replay import RoutingStats

# generated tokens with recorded routing that get the with/without-replay pair (a sample of the round)
ROUTING_DIAGNOSTIC_TOKENS = 16384


def routing_diagnostics(stats: RoutingStats, mismatch: torch.Tensor, other: torch.Tensor,
                        replay: bool) -> dict[str, float]:
    """The round's routing metrics: the share of recorded (position, layer) expert sets that differ
    from the trainer's own top-k (overall and per layer, every token of the round), and
    |log pi_k - log mu| mean and p99 with and without replay, over the same tokens (those with
    recorded routing among the first ``ROUTING_DIAGNOSTIC_TOKENS``; ``mismatch`` as the round
    trains, ``other`` with replay the other way)."""
    def q(x: torch.Tensor, f) -> float:
        return float(f(x.double())) if x.numel() else float("nan")

    on, off = (mismatch, other) if replay else (other, mismatch)
    out = {**stats.as_metrics(), "routing_diagnostic_tokens": float(mismatch.numel())}
    for name, x in (("replay", on), ("no_replay", off)):
        out[f"mismatch_{name}_mean"] = q(x, torch.mean)
        out[f"mismatch_{name}_p99"] = q(x, lambda t: np.quantile(t.cpu().numpy(), 0.99))  # torch's caps the size
    return out


@dataclass
class RoundDiagnostics:
    """Collects the pi_k pass's per-token figures on this rank; ``world_size > 1``: one rank of an
    initialised process group, whose collectives run on ``device``."""

    replay: bool
    layers: int = 0  # MoE layers (the routing statistics' length on every rank)
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stats: RoutingStats = field(default_factory=RoutingStats)
    mismatch: list[torch.Tensor] = field(default_factory=list)  # |log pi_k - log mu| with the round's routing
    recorded: list[torch.Tensor] = field(default_factory=list)  # the same, on tokens with recorded routing
    other: list[torch.Tensor] = field(default_factory=list)  # ... with replay the other way
    sampled: int = 0  # tokens in ``other`` over all ranks, as of the last ``due``
    sampled_any: bool = False  # some rank ran the extra forward
    _unshared: int = 0  # tokens this rank added to ``other`` since the last ``due``

    def _sum(self, values: list[int]) -> list[int]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def due(self, b: PackedBatch) -> bool:
        """Whether this micro-batch index gets the extra forward: the same answer on every rank (a
        collective: every rank calls it for every micro-batch of the pi_k pass, in order)."""
        wanted, added = self._sum([int(not b.filler and b.routing is not None), self._unshared])
        self._unshared = 0
        self.sampled += added
        run = wanted > 0 and self.sampled < ROUTING_DIAGNOSTIC_TOKENS
        self.sampled_any |= run
        return run

    def add(self, b: PackedBatch, mismatch: torch.Tensor, other: torch.Tensor | None = None) -> None:
        """A micro-batch's |log pi_k - log mu| per token and, where the extra forward ran, the same
        with replay the other way (kept on its tokens with recorded routing)."""
        if b.filler:
            return
        self.mismatch.append(mismatch)
        if other is not None and b.routing is not None:
            known = b.routing_known[b.gen_row, b.gen_pos]
            self.recorded.append(mismatch[known])
            self.other.append(other[known])
            self._unshared += int(known.sum())

    def _gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's ``parts``, concatenated (rank by rank)."""
        x = torch.cat(parts).float() if parts else torch.zeros(0)
        if self.world_size == 1:
            return x
        n = torch.tensor([x.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n)
        sizes = [int(s) for s in sizes]
        padded = torch.zeros(max(sizes), dtype=torch.float32, device=self.device)
        padded[:x.numel()] = x.to(self.device)
        out = [torch.zeros_like(padded) for _ in sizes]
        dist.all_gather(out, padded)
        return torch.cat([o[:s] for o, s in zip(out, sizes)]).cpu()

    def mismatch_abs_logp(self) -> float:
        """Mean |log pi_k - log mu| over the round's tokens (every rank's; a collective)."""
        x = torch.cat(self.mismatch).double() if self.mismatch else torch.zeros(0, dtype=torch.float64)
        total = torch.tensor([float(x.sum()), float(x.numel())], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(total)
        return float(total[0] / total[1]) if total[1] else float("nan")

    def routing(self) -> dict[str, float]:
        """``routing_diagnostics`` over every rank's tokens ({} when no extra forward ran; a
        collective where one did)."""
        if not self.sampled_any:
            return {}
        stats = self.stats
        if self.world_size > 1:
            pad = [0] * (self.layers - len(stats.positions))
            counts = torch.tensor([stats.positions + pad, stats.differ + pad], dtype=torch.long, device=self.device)
            dist.all_reduce(counts)
            stats = RoutingStats(*counts.tolist())
        return routing_diagnostics(stats, self._gather(self.recorded), self._gather(self.other), self.replay)
