"""Choosing a round's training data from the trajectory store (DESIGN.md sections 3 and 5).

Eligible trajectory: every call's policy_version is in the round's policy window (the live version
and the ``max_policy_lag`` versions before it in ``version_order``; 0 = sync), it has a reward row,
it passes validation, and no other round's ledger holds it. The round takes exactly ``n_required``
of them, oldest first (earliest call ``created_at``; null timestamps last; ties by trajectory_id).

Trajectories without a reward row yet are *pending*: neither eligible nor quarantined, they may
become eligible later. Quarantined trajectories go into the round's ledger with status
"quarantined", so later rounds neither train on them nor quarantine them again.

Episodes that cross versions (``crossing``): besides the window's partitions, selection reads the
key columns of the window's trajectories' calls recorded since the window's first call in the
predecessor's partition and in those of versions not in the history. A call under the predecessor,
or under a version another deployment passed over, quarantines the trajectory
(``crossed_versions``); a call under a version that may still enter the window (a running canary, a
wave in progress) holds it back (``n_pending_versions``, breakdown ``pending_other_version``).

What is read: the window's partitions, and for the window's trajectories only (the filter goes into
each scan) their rewards, retractions and ledger rows, and those key columns. Never the history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.trajectories.crossing import Window, classify, first_call_at
from prodrl_pipelines.trajectories.store import TrajectoryStore, without_retracted
from prodrl_pipelines.trajectories.validation import validate_rows


class InsufficientDataError(RuntimeError):
    """Fewer eligible trajectories than the round needs. Carries the numbers as attributes."""

    def __init__(self, message: str, *, n_required: int, n_eligible: int, breakdown: dict[str, int]) -> None:
        super().__init__(message)
        self.n_required = n_required
        self.n_eligible = n_eligible
        self.breakdown = breakdown


@dataclass(frozen=True)
class SelectionResult:
    """``dataset``: the chosen trajectories' calls (CALL_SCHEMA + ``reward`` float64), ordered by
    trajectory (oldest first) then call_index. ``quarantine_counts``: reason code -> trajectories
    (``validation.ValidationResult.counts``). ``n_eligible``: eligible trajectories before taking
    ``n_required``. ``n_quarantined``: trajectories with quarantined rows this round.
    """

    dataset: pa.Table
    quarantine_counts: dict[str, int]
    n_eligible: int
    n_quarantined: int
    trajectory_ids: list[str] = field(default_factory=list)
    policy_versions: list[str] = field(default_factory=list)
    n_pending: int = 0  # in the window, not yet used, no reward row yet
    n_used_elsewhere: int = 0  # in the window but in another round's ledger
    n_pending_versions: int = 0  # held back: a call under a version that may still enter the window
    seed: int | None = None
    # the store's table versions this selection read: re-reading them reproduces it (time travel)
    table_versions: dict[str, int] = field(default_factory=dict)

    @property
    def quarantined(self) -> dict[str, int]:
        return self.quarantine_counts


def _candidates(
    store: TrajectoryStore, calls: pa.Table, rewards: pa.Table, exclude_round: str | None, as_of,
    crossed: set[str], held: set[str],
) -> tuple[np.ndarray, int, int, int]:
    """Row mask of the trajectories to validate: not ledgered, not held back, and rewarded or
    crossed (a crossed one is quarantined with or without a reward); also (n_used, n_pending,
    n_held). The ledger is read for the window's trajectories only (the filter goes into the scan)."""
    ids = calls.column("trajectory_id")
    used = store.used_trajectory_ids(exclude_round=exclude_round, trajectory_ids=pc.unique(ids).to_pylist(),
                                     as_of=as_of)

    def among(names) -> pa.ChunkedArray:
        return pc.is_in(ids, value_set=pa.array(sorted(names), pa.string()))

    free = pc.invert(among(used))
    held_mask = pc.and_(free, among(held))
    free = pc.and_(free, pc.invert(held_mask))
    rewarded = pc.is_in(ids, value_set=rewards.column("trajectory_id"))
    crossed_mask = among(crossed)
    pending_mask = pc.and_(free, pc.invert(pc.or_(rewarded, crossed_mask)))

    def n_of(mask) -> int:
        return len(pc.unique(ids.filter(mask)))

    keep = pc.and_(free, pc.or_(rewarded, crossed_mask))
    return (keep.to_numpy(zero_copy_only=False).astype(bool), n_of(pc.invert(pc.or_(free, held_mask))),
            n_of(pending_mask), n_of(held_mask))


def _window_calls(store: TrajectoryStore, win: Window, pinned) -> tuple[pa.Table, dict[str, str], set[str]]:
    """The window's calls (retracted rows left out), and its trajectories crossed / held back by
    calls outside the window (``crossing``). Retractions and the outside calls are read for the
    window's trajectories only."""
    calls = store.read_calls(win.versions, dedupe=False, retracted=True, as_of=pinned)
    if calls.num_rows == 0:
        return calls, {}, set()
    first_at = first_call_at(calls, win.versions)
    live_first_at = first_call_at(calls, [win.live])
    ids = pc.unique(calls.column("trajectory_id")).to_pylist()
    retractions = store.read_retractions(trajectory_ids=ids, as_of=pinned)
    if retractions.num_rows:
        calls = without_retracted(calls, retractions)
    if first_at is None:  # no timestamps in the window: nothing to compare outside calls with
        return calls, {}, set()
    outside = store.read_call_keys(skip_versions=win.outside_partitions_skipped(), since=first_at,
                                   trajectory_ids=ids, as_of=pinned)
    if retractions.num_rows and outside.num_rows:
        outside = without_retracted(outside, retractions)
    crossed, held = classify(outside, win, live_first_at)
    return calls, crossed, held


def select_round_dataset(
    store: TrajectoryStore,
    round_key: str,
    live_version: str,
    version_order: list[str],
    max_policy_lag: int,
    n_required: int,
    vocab_size: int,
    seed: int | None = None,
    *,
    requirement: str | None = None,
    as_of: dict[str, int] | None = None,
    record: bool = True,
    routing_shape: tuple[int, int, int] | None = None,
    resolve_rewards=None,
) -> SelectionResult:
    """Validate the window's rewarded, unused trajectories and take the ``n_required`` oldest.

    Writes the round's quarantine rows (replacing earlier ones of this round) and its ledger
    (overwritten), so re-materialising a round is idempotent as long as no new data arrived.
    Raises ``InsufficientDataError`` (writing nothing) when fewer than ``n_required`` are eligible;
    ``requirement`` is a human explanation of ``n_required`` for that message, e.g.
    ``"S*B = steps_per_round=8 x batch_size=8"``. ``seed`` is recorded only: the choice is
    deterministic without it. The table versions read are pinned first (``table_versions`` of the
    result); ``as_of`` re-reads earlier pinned versions, and ``record=False`` writes nothing: together
    they reproduce a decided round's selection exactly, whatever arrived or was compacted since.
    ``routing_shape``: the policy's (MoE layers, experts per token, experts), which recorded routing
    must fit (``validation_rules.routing_rule``). ``resolve_rewards``: every stored reward row of the
    window's trajectories -> one row per rewarded trajectory (the configured sources and their
    combination, ``rewards.scoring.RewardPlan.resolve``); default: the newest row wins.
    """
    if n_required < 1:
        raise ValueError(f"n_required must be >= 1, got {n_required}")
    win = Window.of(live_version, version_order, max_policy_lag)
    window = win.versions
    pinned = dict(as_of) if as_of is not None else store.versions()
    calls, crossed, held = _window_calls(store, win, pinned)
    window_ids = pc.unique(calls.column("trajectory_id")).to_pylist()
    if resolve_rewards is None:
        rewards = store.read_rewards(trajectory_ids=window_ids, as_of=pinned)
    else:
        rewards = resolve_rewards(store.read_rewards(latest=False, trajectory_ids=window_ids, as_of=pinned))
    include, n_used, n_pending, n_held = _candidates(store, calls, rewards, round_key, pinned, set(crossed), held)
    verdict = validate_rows(
        calls, rewards, vocab_size, set(version_order), check_top=True, check_prompt=True, include=include,
        routing_shape=routing_shape, crossed=crossed,
    )
    n_quarantined = verdict.n_quarantined_trajectories()

    # Age of each eligible trajectory = its earliest call (null timestamps last); oldest first.
    keep, t = verdict.keep, verdict.t
    ts = pc.fill_null(verdict.calls.column("created_at").cast(pa.int64()), np.iinfo(np.int64).max)
    ts = ts.to_numpy().astype(np.int64)
    age = np.full(len(verdict.traj_ids), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(age, t[keep], ts[keep])
    eligible = np.unique(t[keep]).tolist()
    n_eligible = len(eligible)
    if n_eligible < n_required:
        need = f"{n_required} trajectories" + (f" ({requirement})" if requirement else "")
        breakdown = {
            "eligible": n_eligible,
            "pending_reward": n_pending,
            "pending_other_version": n_held,
            "used_by_other_rounds": n_used,
            "quarantined": n_quarantined,
        }
        raise InsufficientDataError(
            f"round {round_key!r} needs {need} but only {n_eligible} eligible in policy versions "
            f"{window} (live {live_version!r}, max_policy_lag={max_policy_lag}); "
            f"{n_pending} still await a reward, {n_held} are held back by a call under a version that may "
            f"still enter the window (a canary, a rolling wave), {n_used} were consumed by other rounds (trained on "
            f"or quarantined), {n_quarantined} were quarantined. Wait for more rewarded traffic, "
            f"lower the requirement, or raise max_policy_lag.",
            n_required=n_required,
            n_eligible=n_eligible,
            breakdown=breakdown,
        )
    ids = verdict.traj_ids
    chosen = sorted(eligible, key=lambda c: (age[c], ids[c]))[:n_required]
    rank = np.full(len(ids), -1, dtype=np.int64)
    rank[chosen] = np.arange(len(chosen))
    rows = np.flatnonzero(keep & (rank[t] >= 0))
    rows = rows[np.lexsort((verdict.ci[rows], rank[t[rows]]))]
    dataset = verdict.valid_table(rows)
    chosen_ids = [ids[c] for c in chosen]

    if record:
        store.write_quarantine(verdict.quarantine_table(), round_key, replace=True)
        store.write_ledger(round_key, chosen_ids, verdict.rejected_trajectory_ids())
    return SelectionResult(
        dataset=dataset,
        quarantine_counts=verdict.counts,
        n_eligible=n_eligible,
        n_quarantined=n_quarantined,
        trajectory_ids=chosen_ids,
        policy_versions=window,
        n_pending=n_pending,
        n_used_elsewhere=n_used,
        n_pending_versions=n_held,
        seed=seed,
        table_versions=pinned,
    )


def count_eligible(
    store: TrajectoryStore,
    live_version: str,
    version_order: list[str],
    max_policy_lag: int,
    vocab_size: int,
    needs_reward: bool = True,
    report: bool = False,
):
    """Cheap upper bound of ``select_round_dataset``'s ``n_eligible``, for a sensor.

    Incremental (``eligibility.EligibilityTracker``): reads only the commits since the last count
    and the files they added. Excludes trajectories without a reward or with a null / non-finite
    one, those in any round's ledger, and those failing the simple rules (call indices, empty
    generation, length mismatch, output token range, non-finite output logprob). Skips the prompt
    and top-K checks and duplicate conflicts, so it may count a few that selection then quarantines.
    ``report=True``: the tick's ``TickReport`` (with how many were recorded and rewarded) instead.
    """
    from prodrl_pipelines.trajectories.eligibility import EligibilityTracker

    return EligibilityTracker(store, vocab_size).count(live_version, version_order, max_policy_lag,
                                                       needs_reward=needs_reward, report=report)
