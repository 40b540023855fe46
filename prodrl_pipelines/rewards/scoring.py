"""Scoring stored trajectories with the configured sources, and re-scoring them with a source's
current version. Both only append reward rows: an old version's rows stay, and selection reads the
version the settings name (``RewardPlan.versions``). Only complete episodes are scored
(``rewards.completion``); one still under way is counted ``in_flight`` and asked again later.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm.auto import tqdm

from prodrl_pipelines.rewards.combine import combine, rows_of
from prodrl_pipelines.rewards.completion import completion, fresh_rows
from prodrl_pipelines.rewards.sources import make_source
from prodrl_pipelines.rewards.view import views_from_calls
from prodrl_pipelines.trajectories.rows import conform, latest_rewards
from prodrl_pipelines.trajectories.schema import REWARD_SCHEMA


class RewardPlan:
    """The configured sources (``RewardSettings``), built once: their versions and the combination."""

    def __init__(self, settings, sources: dict | None = None) -> None:
        self.settings = settings
        self.sources = sources or {name: make_source(name, settings) for name in settings.sources}

    def current_version(self, name: str) -> str | None:
        return self.sources[name].version

    def versions(self) -> dict[str, str | None]:
        """The version selection reads per source: the pinned one, else the current one."""
        return {n: self.settings.versions.get(n, self.current_version(n)) for n in self.settings.sources}

    def resolve(self, rewards: pa.Table) -> pa.Table:
        """One reward per trajectory that has one (``combine``)."""
        return combine(rewards, self.settings.sources, self.versions(), self.settings.combine, self.settings.weights)

    def cannot_reward_new_traffic(self) -> str | None:
        """Why no trajectory recorded from now on can get a reward under this plan, or None: a scorer
        pinned to an older version (``rewards_versions``) is read, never written, so traffic it must
        reward (every source under ``weighted``, all of them under ``first``) stays unrewarded."""
        vs = self.versions()
        stuck = [n for n in self.settings.sources if self.sources[n].scores and vs[n] != self.current_version(n)]
        needs_all = self.settings.combine == "weighted"
        if stuck and (needs_all or len(stuck) == len(self.settings.sources)):
            return (f"rewards_sources {list(self.settings.sources)} with rewards_versions pinning "
                    f"{', '.join(f'{n}@{vs[n]}' for n in stuck)} (current: "
                    f"{', '.join(f'{n}@{self.current_version(n)}' for n in stuck)}): a pinned version is never "
                    f"written, so new traffic is never rewarded under rewards_combine {self.settings.combine!r}")
        return None

    def describe(self) -> str:
        vs = self.versions()
        return f"{self.settings.combine}(" + ", ".join(f"{n}@{vs[n] or 'client'}" for n in self.settings.sources) + ")"


@dataclass
class SourceReport:
    source: str
    version: str | None
    candidates: int = 0  # trajectories this source was asked to score
    already: int = 0  # had a row of this version: not scored again
    skipped: int = 0  # an earlier source (``first``) already rewards them
    scored: int = 0
    pending: int = 0  # the source answered None ("cannot tell")
    failed: int = 0
    in_flight: int = 0  # episodes still under way (``rewards.completion``): scored once complete
    first_error: str = ""
    rewards: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        r = np.asarray(d.pop("rewards"), dtype=np.float64)
        d.update(reward_mean=float(r.mean()) if r.size else float("nan"),
                 reward_std=float(r.std()) if r.size else float("nan"))
        return d


def _rows(outcomes, views, source: str, version: str, last_call_us: dict[str, int] | None = None) -> list[dict]:
    """Reward rows, stamped now but never before the last call scored (see ``rewards.completion``)."""
    now = datetime.now(timezone.utc)
    last = last_call_us or {}

    def at(tid: str) -> datetime:
        us = last.get(tid, -1)
        return max(now, datetime.fromtimestamp(us / 1e6, timezone.utc)) if us >= 0 else now

    return [{"trajectory_id": v.trajectory_id, "reward": o.reward, "source": source,
             "created_at": at(v.trajectory_id), "version": version}
            for v, o in zip(views, outcomes) if o.reward is not None]


def _run_source(src, views, report: SourceReport, desc: str) -> list:
    with tqdm(total=len(views), desc=desc, unit="traj", leave=False, disable=not views) as bar:
        outcomes = src.score(views, progress=bar.update)
    for o in outcomes:
        if o.error:
            report.failed += 1
            report.first_error = report.first_error or o.error
        elif o.reward is None:
            report.pending += 1
        else:
            report.scored += 1
            report.rewards.append(o.reward)
    return outcomes


def score_missing(store, plan: RewardPlan, calls: pa.Table, now_us: int | None = None) -> dict[str, SourceReport]:
    """Score the complete trajectories of ``calls`` (CALL_SCHEMA, with ``created_at``) that lack a
    row of a scorer's current version as new as their last call, source by source in ``sources``
    order, one append per source. With the ``first`` rule a trajectory an earlier source already
    rewards is not sent to later ones. Episodes under way at ``now_us`` (default now) are counted
    ``in_flight``, not scored. Idempotent: a re-run scores only what is still missing (failures and
    "cannot tell" are asked again)."""
    ids = list(dict.fromkeys(calls.column("trajectory_id").to_pylist()))
    stored = store.read_rewards(latest=False, trajectory_ids=ids) if ids else REWARD_SCHEMA.empty_table()
    stored = conform(stored, REWARD_SCHEMA)
    done = completion(calls, stored, plan.settings.idle_seconds, now_us)
    versions = plan.versions()
    rewarded_before: set[str] = set()
    reports: dict[str, SourceReport] = {}
    for name in plan.settings.sources:
        src = plan.sources[name]
        mine = rows_of(stored, name, versions[name] if src.scores else None)
        have = {t for t, r in zip(mine.column("trajectory_id").to_pylist(), mine.column("reward").to_pylist())
                if r is not None}
        if not src.scores:
            rewarded_before |= have
            continue
        current = src.version
        rep = reports[name] = SourceReport(name, current, candidates=len(ids))
        if current != versions[name]:  # pinned to an older version: read, never written here
            rep.already = len(have)
            rewarded_before |= have
            continue
        have = fresh_rows(mine, done.last_call_us)  # a grade older than the last call is re-scored
        todo = [t for t in ids if t not in have]
        rep.already = len(ids) - len(todo)
        if plan.settings.combine == "first":
            rep.skipped = sum(t in rewarded_before for t in todo)
            todo = [t for t in todo if t not in rewarded_before]
        rep.in_flight = sum(t in done.in_flight for t in todo)
        todo = [t for t in todo if t in done.complete]
        views = views_from_calls(calls.filter(pc.is_in(calls.column("trajectory_id"),
                                                         value_set=pa.array(todo, pa.string()))))
        outcomes = _run_source(src, views, rep, f"scoring with {name}")
        new = _rows(outcomes, views, name, current, done.last_call_us)
        store.write_rewards(new)
        rewarded_before |= have | {r["trajectory_id"] for r in new}
    return reports


@dataclass
class RescoreReport:
    source: str
    version: str
    from_versions: list[str]
    trajectories: int = 0  # with a row of an old version and none of the current one
    scored: int = 0
    pending: int = 0
    failed: int = 0
    first_error: str = ""
    changed: int = 0  # new reward differs from the old one
    mean_abs_change: float = 0.0
    max_abs_change: float = 0.0
    old_mean: float = float("nan")
    new_mean: float = float("nan")
    already_trained: int = 0  # already trained on: those rounds keep the rewards they used

    def summary(self) -> str:
        return (f"rescored {self.scored} of {self.trajectories} trajectories with {self.source}@{self.version} "
                f"(from {', '.join(self.from_versions) or 'no older version'}): {self.changed} rewards changed, "
                f"mean |change| {self.mean_abs_change:.4f}, max {self.max_abs_change:.4f}; mean reward "
                f"{self.old_mean:.4f} -> {self.new_mean:.4f}; {self.pending} unscored, {self.failed} failed"
                + (f" (first error: {self.first_error})" if self.first_error else "")
                + f"; {self.already_trained} were trained on already: those rounds keep the rewards they used")


def rescore(store, plan: RewardPlan, source: str, versions: Sequence[str] | None = None) -> RescoreReport:
    """Re-score with ``source``'s current version the stored trajectories that have a row of an
    older version (of ``versions`` when given) and none of the current one. Appends the new rows;
    the old ones stay (``rewards_versions`` can pin selection back to them)."""
    if source not in plan.sources:
        raise ValueError(f"--source {source!r} is not a configured reward source ({list(plan.settings.sources)})")
    src = plan.sources[source]
    if not src.scores:
        raise ValueError(f"--source {source!r} does not score: its rewards come from clients")
    current = src.version
    rows = conform(store.read_rewards(latest=False), REWARD_SCHEMA)
    rows = rows.filter(pc.fill_null(pc.equal(rows.column("source"), source), False))
    vers = rows.column("version").to_pylist()
    tids = rows.column("trajectory_id").to_pylist()
    have_current = {t for t, v in zip(tids, vers) if v == current}
    wanted = set(versions) if versions else {v for v in vers if v is not None and v != current}
    if versions and current in wanted:
        raise ValueError(f"--versions names the current version {current!r}: nothing to re-score from it")
    old = latest_rewards(rows.filter(pc.is_in(rows.column("version"), value_set=pa.array(sorted(wanted), pa.string()))))
    old_by = dict(zip(old.column("trajectory_id").to_pylist(), old.column("reward").to_pylist()))
    targets = [t for t in old_by if t not in have_current]
    rep = RescoreReport(source, current, sorted(wanted), trajectories=len(targets))
    if not targets:
        return rep
    calls = store.read_calls(trajectory_ids=targets)
    views = views_from_calls(calls)
    tmp = SourceReport(source, current)
    outcomes = _run_source(src, views, tmp, f"re-scoring with {source}")
    rep.scored, rep.pending, rep.failed, rep.first_error = tmp.scored, tmp.pending, tmp.failed, tmp.first_error
    new = _rows(outcomes, views, source, current)
    store.write_rewards(new)
    pairs = [(old_by[r["trajectory_id"]], r["reward"]) for r in new if old_by.get(r["trajectory_id"]) is not None]
    if pairs:
        o, n = np.asarray(pairs, dtype=np.float64).T
        d = np.abs(n - o)
        rep.changed = int((d > 1e-12).sum())
        rep.mean_abs_change, rep.max_abs_change = float(d.mean()), float(d.max())
        rep.old_mean, rep.new_mean = float(o.mean()), float(n.mean())
    rep.already_trained = len(store.used_trajectory_ids(include_quarantined=False, trajectory_ids=targets))
    return rep
