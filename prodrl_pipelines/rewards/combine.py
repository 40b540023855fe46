"""From the stored reward rows to one reward per trajectory: each configured source's rows at the
version selection reads (the newest row per trajectory), then a combination rule (``COMBINE_RULES``).

- ``first``: the first source in ``sources`` order that has a reward (e.g. feedback wins, else the
  grader);
- ``weighted``: sum of ``weights[source] x reward``, once every source has one (a trajectory some
  source has not scored yet stays pending).

A trajectory no rule gives a reward is pending: left out of the result.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.trajectories.rows import conform, latest_rewards
from prodrl_pipelines.trajectories.schema import REWARD_SCHEMA


def rows_of(rewards: pa.Table, source: str, version: str | None) -> pa.Table:
    """The rows of one source at one version: for ``feedback`` (``version`` None) every row a client
    posted (no version, whatever label it gave); for a scorer its rows of that version."""
    if "version" not in rewards.column_names:
        rewards = conform(rewards, REWARD_SCHEMA)
    if version is None:
        return rewards.filter(pc.is_null(rewards.column("version")))
    mask = pc.and_(pc.equal(rewards.column("source"), source), pc.equal(rewards.column("version"), version))
    return rewards.filter(pc.fill_null(mask, False))


class _Source:
    """One source's newest row per trajectory: the rows (``table``) and trajectory -> (reward, row)."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.rewards = {tid: (r, row) for row, (tid, r) in
                        enumerate(zip(table.column("trajectory_id").to_pylist(), table.column("reward").to_pylist()))
                        if r is not None}


def _by_source(rewards: pa.Table, sources: Sequence[str], versions: Mapping[str, str | None]) -> dict[str, _Source]:
    return {s: _Source(latest_rewards(rows_of(rewards, s, versions.get(s)))) for s in sources}


def combine_first(per: dict[str, _Source], sources: Sequence[str], weights: Mapping[str, float]) -> pa.Table:
    picked: dict[str, tuple[str, int]] = {}
    for s in sources:
        for tid, (_, row) in per[s].rewards.items():
            picked.setdefault(tid, (s, row))
    parts = []
    for s in sources:
        rows = sorted(row for src, row in picked.values() if src == s)
        if rows:
            parts.append(per[s].table.take(pa.array(rows)))
    return conform(pa.concat_tables(parts) if parts else REWARD_SCHEMA.empty_table(), REWARD_SCHEMA)


def combine_weighted(per: dict[str, _Source], sources: Sequence[str], weights: Mapping[str, float]) -> pa.Table:
    ids = sorted(set.intersection(*(set(per[s].rewards) for s in sources)))
    total = [sum(weights[s] * per[s].rewards[t][0] for s in sources) for t in ids]
    return pa.table({"trajectory_id": pa.array(ids, pa.string()), "reward": pa.array(total, pa.float64()),
                     "source": pa.array(["weighted"] * len(ids), pa.string()),
                     "created_at": pa.nulls(len(ids), REWARD_SCHEMA.field("created_at").type),
                     "version": pa.array(["+".join(f"{weights[s]}*{s}" for s in sources)] * len(ids), pa.string())},
                    schema=REWARD_SCHEMA)


COMBINE_RULES: dict[str, Callable] = {"first": combine_first, "weighted": combine_weighted}


def combine(rewards: pa.Table, sources: Sequence[str], versions: Mapping[str, str | None], rule: str = "first",
            weights: Mapping[str, float] | None = None) -> pa.Table:
    """One REWARD_SCHEMA row per trajectory that has a reward under ``rule`` (see the module doc).
    ``versions``: the version read per scorer source (feedback: None)."""
    if rule not in COMBINE_RULES:
        raise ValueError(f"unknown combination rule {rule!r}; known: {', '.join(sorted(COMBINE_RULES))}")
    per = _by_source(rewards, sources, versions)
    return COMBINE_RULES[rule](per, list(sources), dict(weights or {}))
