"""Scoring stored trajectories with the configured sources, and re-scoring them with a source's
current version. Both only append reward rows: an old version's rows stay, and selection reads the
version the settings name (``RewardPlan.versions``). Only complete episodes are scored
(``rewards.completion``); one still under way is counted ``in_flight`` and asked again later.

Where the sources run is the ``runner``'s choice (``rewards.runners``: this process, or a Ray Data
actor pool); the rows are the same. A job writes its rows in one commit carrying an application
transaction (app id: the job's inputs; version: the rewards table version it read, plus one), so an
attempt that read the same snapshot as one that already committed (a retry after a crash, an
overlapping re-run) writes nothing.
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
from prodrl_pipelines.rewards.outcome import short_hash
from prodrl_pipelines.rewards.runners import LOCAL, Runner, run_source
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


def _run_source(plan: RewardPlan, name: str, views, report: SourceReport, desc: str, runner: Runner) -> list:
    with tqdm(total=len(views), desc=desc, unit="traj", leave=False, disable=not views) as bar:
        outcomes = run_source(runner, name, plan.sources[name], views, plan.settings, progress=bar.update)
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


def read_version(store) -> int:
    """The rewards table's latest version (-1: none yet): what a job reads, and its commit names."""
    from prodrl_pipelines.trajectories.store import REWARDS

    return store.versions()[REWARDS]


def commit_once(store, rows: list[dict], app_id: str, read_at: int) -> int | None:
    """Append ``rows`` in one commit recording (``app_id``, ``read_at + 1``), unless a commit of
    ``app_id`` already records a read at least that new (then its rows are these: None). Returns
    the committed version (None when nothing was written)."""
    from prodrl_pipelines.trajectories.store import REWARDS

    if not rows:
        return None
    done = store.tables.txn_version(REWARDS, app_id)
    if done is not None and done >= read_at + 1:
        return None
    return store.write_rewards(rows, txn=(app_id, read_at + 1))


def score_missing(store, plan: RewardPlan, calls: pa.Table, now_us: int | None = None,
                  runner: Runner = LOCAL) -> dict[str, SourceReport]:
    """Score the complete trajectories of ``calls`` (CALL_SCHEMA, with ``created_at``) that lack a
    row of a scorer's current version as new as their last call, source by source in ``sources``
    order, every source's rows in one commit. With the ``first`` rule a trajectory an earlier
    source already rewards is not sent to later ones. Episodes under way at ``now_us`` (default now)
    are counted ``in_flight``, not scored. Idempotent: a re-run scores only what is still missing
    (failures and "cannot tell" are asked again)."""
    from prodrl_pipelines.trajectories.store import REWARDS

    ids = list(dict.fromkeys(calls.column("trajectory_id").to_pylist()))
    read_at = read_version(store)
    stored = store.read_rewards(latest=False, trajectory_ids=ids, as_of={REWARDS: read_at}) if ids \
        else REWARD_SCHEMA.empty_table()
    stored = conform(stored, REWARD_SCHEMA)
    done = completion(calls, stored, plan.settings.idle_seconds, now_us)
    versions = plan.versions()
    rewarded_before: set[str] = set()
    reports: dict[str, SourceReport] = {}
    written: list[dict] = []
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
        outcomes = _run_source(plan, name, views, rep, f"scoring with {name}", runner)
        new = _rows(outcomes, views, name, current, done.last_call_us)
        written += new
        rewarded_before |= have | {r["trajectory_id"] for r in new}
    app_id = "prodrl-score-" + short_hash(plan.describe(), *sorted(ids))
    commit_once(store, written, app_id, read_at)
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
    committed_version: int | None = None  # the rewards table version of this job's one commit (None: none)

    def summary(self) -> str:
        return (f"rescored {self.scored} of {self.trajectories} trajectories with {self.source}@{self.version} "
                f"(from {', '.join(self.from_versions) or 'no older version'}): {self.changed} rewards changed, "
                f"mean |change| {self.mean_abs_change:.4f}, max {self.max_abs_change:.4f}; mean reward "
                f"{self.old_mean:.4f} -> {self.new_mean:.4f}; {self.pending} unscored, {self.failed} failed"
                + (f" (first error: {self.first_error})" if self.first_error else "")
                + f"; {self.already_trained} were trained on already: those rounds keep the rewards they used")


def check_rescore_source(plan: RewardPlan, source: str):
    """The source ``rescore`` would re-score with; a ValueError says why ``source`` cannot be."""
    if source not in plan.sources:
        raise ValueError(f"--source {source!r} is not a configured reward source ({list(plan.settings.sources)})")
    src = plan.sources[source]
    if not src.scores:
        raise ValueError(f"--source {source!r} does not score: its rewards come from clients")
    return src


def rescore(store, plan: RewardPlan, source: str, versions: Sequence[str] | None = None,
            runner: Runner = LOCAL) -> RescoreReport:
    """Re-score with ``source``'s current version the stored trajectories that have a row of an
    older version (of ``versions`` when given) and none of the current one. Appends the new rows in
    one commit; the old ones stay (``rewards_versions`` can pin selection back to them)."""
    from prodrl_pipelines.trajectories.store import REWARDS

    src = check_rescore_source(plan, source)
    current = src.version
    read_at = read_version(store)
    rows = conform(store.read_rewards(latest=False, as_of={REWARDS: read_at}), REWARD_SCHEMA)
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
    outcomes = _run_source(plan, source, views, tmp, f"re-scoring with {source}", runner)
    rep.scored, rep.pending, rep.failed, rep.first_error = tmp.scored, tmp.pending, tmp.failed, tmp.first_error
    new = _rows(outcomes, views, source, current)
    rep.committed_version = commit_once(store, new, "prodrl-rescore-" + short_hash(source, current, *sorted(targets)),
                                        read_at)
    pairs = [(old_by[r["trajectory_id"]], r["reward"]) for r in new if old_by.get(r["trajectory_id"]) is not None]
    if pairs:
        o, n = np.asarray(pairs, dtype=np.float64).T
        d = np.abs(n - o)
        rep.changed = int((d > 1e-12).sum())
        rep.mean_abs_change, rep.max_abs_change = float(d.mean()), float(d.max())
        rep.old_mean, rep.new_mean = float(o.mean()), float(n.mean())
    rep.already_trained = len(store.used_trajectory_ids(include_quarantined=False, trajectory_ids=targets))
    return rep
