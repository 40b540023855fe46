"""Record validation: split recorded calls into trainable trajectories and quarantined rows.

Rules (DESIGN.md section 3), checked in this order; a trajectory is quarantined with the FIRST rule
that fails on any of its calls (the reason names the lowest failing call index and the field):

==========================  ===================================================================
reason code                 failing condition
==========================  ===================================================================
duplicate_call_id           a (trajectory_id, call_index) recorded more than once with different
                            content (``created_at`` ignored). Identical copies only quarantine the
                            extra copies; the first copy in table order is kept.
crossed_versions            a call of the trajectory is under a version outside the policy window
                            that can never enter it (``crossing``; selection passes them in)
bad_call_index              the call indices of a trajectory are not exactly 0..n-1 (or null)
unknown_policy_version      policy_version not in ``known_versions``
empty_generation            output_token_ids null or empty
empty_prompt                prompt_token_ids null or empty (the first output token has no context
                            to be predicted from)
length_mismatch             len(output_logprobs) != len(output_token_ids)
token_id_out_of_range       a prompt, output or top-K token id null or outside [0, vocab_size)
non_finite_logprob          an output or top-K logprob null, NaN or +-inf
bad_sampling                temperature null, non-finite or below 1e-5 (greedy: the trainer divides
                            logits by it), or top_p outside (0, 1]
top_k_shape                 top_token_ids / top_logprobs row count != number of output tokens, or
                            a row shorter than K (K = longest row of that call, per column), K = 0,
                            or K differs between top_token_ids and top_logprobs
bad_routing                 recorded MoE routing (optional) that cannot be decoded, does not cover
                            the call's forwarded positions, repeats an expert at a position, or
                            does not fit the policy's MoE shape
missing_reward              no reward row, or a null reward
non_finite_reward           reward NaN or +-inf
==========================  ===================================================================

The rules themselves are in ``validation_rules``, vectorised with numpy; Python loops run only over
quarantined trajectories and extra duplicate copies, to build reason strings.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.trajectories.schema import CALL_SCHEMA, QUARANTINE_SCHEMA, REWARD_SCHEMA
from prodrl_pipelines.trajectories.validation_rules import (
    CallRows,
    Rule,
    TrajectoryRewards,
    call_index_rule,
    crossed_rule,
    duplicate_rule,
    length_rules,
    logprob_rule,
    one_chunk,
    policy_version_rule,
    reward_rules,
    routing_rule,
    sampling_rule,
    token_id_rule,
    top_k_shape_rule,
    trajectory_rewards,
)

REASONS: tuple[str, ...] = (
    "duplicate_call_id",
    "crossed_versions",
    "bad_call_index",
    "unknown_policy_version",
    "empty_generation",
    "empty_prompt",
    "length_mismatch",
    "token_id_out_of_range",
    "non_finite_logprob",
    "bad_sampling",
    "top_k_shape",
    "bad_routing",
    "missing_reward",
    "non_finite_reward",
)

REQUIRED_CALL_COLUMNS: tuple[str, ...] = (
    "trajectory_id",
    "call_index",
    "policy_version",
    "prompt_token_ids",
    "output_token_ids",
    "output_logprobs",
    "top_token_ids",
    "top_logprobs",
)
REQUIRED_REWARD_COLUMNS: tuple[str, ...] = ("trajectory_id", "reward")

VALID_SCHEMA = CALL_SCHEMA.append(pa.field("reward", pa.float64()))


@dataclass(frozen=True)
class ValidationResult:
    """``valid``: calls of valid trajectories (CALL_SCHEMA + ``reward``), one row per call, in input
    order (first copy of a duplicated call). ``quarantined``: rejected rows (QUARANTINE_SCHEMA).
    ``counts``: reason code -> number of trajectories (every code present, zeros included). A valid
    trajectory whose identical duplicate copies were dropped is counted under ``duplicate_call_id``
    too (its copies are in ``quarantined``, its first copies in ``valid``).
    """

    valid: pa.Table
    quarantined: pa.Table
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def n_valid_trajectories(self) -> int:
        return len(pc.unique(self.valid.column("trajectory_id"))) if self.valid.num_rows else 0

    @property
    def n_quarantined_trajectories(self) -> int:
        """Trajectories with at least one quarantined row (== sum of ``counts``)."""
        return sum(self.counts.values())

    @property
    def quarantined_trajectory_ids(self) -> set[str]:
        """Trajectories rejected as a whole (not those that only lost duplicate copies)."""
        valid = set(pc.unique(self.valid.column("trajectory_id")).to_pylist())
        return set(pc.unique(self.quarantined.column("trajectory_id")).to_pylist()) - valid


def validate_trajectories(
    calls: pa.Table,
    rewards: pa.Table,
    vocab_size: int,
    known_versions: Collection[str],
) -> ValidationResult:
    """Apply every rule of the module docstring. Never raises on bad rows; raises ``ValueError`` only
    when ``calls`` or ``rewards`` lacks a required column or a column has an uncastable type.
    ``rewards`` may hold several rows per trajectory: the latest wins (``store.latest_rewards``).
    """
    return validate_rows(calls, rewards, vocab_size, known_versions, check_top=True, check_prompt=True).result()


# ----------------------------------------------------------------------------- preparation


def _prepare(table: pa.Table, schema: pa.Schema, required: tuple[str, ...], what: str) -> pa.Table:
    """``table`` with exactly ``schema``'s columns, cast, one chunk each (absent optional ones null)."""
    if not isinstance(table, pa.Table):
        raise TypeError(f"{what} must be a pyarrow.Table, got {type(table).__name__}")
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise ValueError(f"{what} table is missing required column(s) {missing}; it has {table.column_names}")
    arrays = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            if col.type != f.type:
                try:
                    col = col.cast(f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                    raise ValueError(
                        f"{what} column {f.name!r} of type {col.type} is not castable to {f.type}: {e}"
                    ) from None
            arrays.append(one_chunk(col))
        else:
            arrays.append(pa.nulls(table.num_rows, f.type))
    # Nullable copy of the schema: nulls in key columns are data problems, handled by the rules.
    return pa.Table.from_arrays(arrays, schema=pa.schema([pa.field(f.name, f.type) for f in schema]))


# ----------------------------------------------------------------------------- the verdict


def validate_rows(
    calls: pa.Table,
    rewards: pa.Table,
    vocab_size: int,
    known_versions: Collection[str],
    *,
    check_top: bool,
    check_prompt: bool,
    include: np.ndarray | None = None,
    routing_shape: tuple[int, int, int] | None = None,
    crossed: Mapping[str, str] | None = None,
) -> RowVerdict:
    """Row-level verdict without materialising the valid table. ``include``: optional row mask;
    rows outside it (whole trajectories, e.g. already used) are ignored: neither valid nor quarantined.
    ``crossed``: trajectories with a call under a version that can never enter the policy window
    (trajectory -> detail, ``crossing.classify``), quarantined as ``crossed_versions``."""
    required = [
        c
        for c in REQUIRED_CALL_COLUMNS
        if (check_top or not c.startswith("top_")) and (check_prompt or c != "prompt_token_ids")
    ]
    calls = _prepare(calls, CALL_SCHEMA, tuple(required), "calls")
    rewards = _prepare(rewards, REWARD_SCHEMA, REQUIRED_REWARD_COLUMNS, "rewards")
    counts = {r: 0 for r in REASONS}
    if calls.num_rows == 0:
        e = np.zeros(0, dtype=np.int64)
        return RowVerdict(calls, pa.nulls(0, pa.float64()), np.zeros(0, bool), e, [], counts, e, [], e)
    rows = CallRows(calls, include)
    rewarded = trajectory_rewards(rows, rewards)
    rules = _rules_in_order(rows, rewarded, vocab_size, known_versions, check_top, check_prompt, routing_shape,
                            crossed)
    return _verdict(rows, rules, rewarded, counts)


def _rules_in_order(rows: CallRows, rewards: TrajectoryRewards, vocab_size: int, known_versions: Collection[str],
                    check_top: bool, check_prompt: bool, routing_shape: tuple[int, int, int] | None = None,
                    crossed: Mapping[str, str] | None = None) -> list[Rule]:
    """Every rule, in the order of the module docstring (the first one failing names the reason)."""
    rules = [
        duplicate_rule(rows),
        crossed_rule(rows, crossed),
        call_index_rule(rows),
        policy_version_rule(rows, known_versions),
        *length_rules(rows, check_prompt),
        token_id_rule(rows, vocab_size, check_top, check_prompt),
        logprob_rule(rows, check_top),
        sampling_rule(rows),
    ]
    if check_top:
        rules.append(top_k_shape_rule(rows))
    rules.append(routing_rule(rows, routing_shape))
    return rules + reward_rules(rows, rewards)


def _first_failures(rows: CallRows, rules: list[Rule]) -> tuple[np.ndarray, np.ndarray]:
    """Per trajectory: index of its first failing rule and the row (lowest call index) that fails it,
    both -1 when none; only first copies of calls count."""
    t, ci = rows.t, rows.ci
    traj_code = np.full(rows.n_traj, -1, dtype=np.int64)
    traj_row = np.full(rows.n_traj, -1, dtype=np.int64)
    for code_i, (_, mask, _) in enumerate(rules):
        cand = np.flatnonzero(mask & rows.primary & (traj_code[t] < 0))
        if not len(cand):
            continue
        order = np.lexsort((ci[cand], t[cand]))
        cand = cand[order]
        tc = t[cand]
        first = np.ones(len(cand), dtype=bool)
        first[1:] = tc[1:] != tc[:-1]
        chosen = cand[first]
        traj_code[t[chosen]] = code_i
        traj_row[t[chosen]] = chosen
    return traj_code, traj_row


def _verdict(rows: CallRows, rules: list[Rule], rewards: TrajectoryRewards, counts: dict[str, int]) -> RowVerdict:
    """Quarantine whole failing trajectories and the extra identical copies of kept calls; count them."""
    t, ci = rows.t, rows.ci
    traj_code, traj_row = _first_failures(rows, rules)
    bad_traj = traj_code >= 0
    reasons = np.empty(rows.n_traj, dtype=object)
    for tt in np.flatnonzero(bad_traj).tolist():
        code, _, describe = rules[traj_code[tt]]
        reasons[tt] = f"{code}: {describe(int(traj_row[tt]))}"
        counts[code] += 1

    row_bad = bad_traj[t]
    copy_only = rows.dup_copy & ~row_bad  # extra identical copies of calls of otherwise-kept trajectories
    dup_traj = np.zeros(rows.n_traj, dtype=bool)
    dup_traj[t[copy_only]] = True
    counts["duplicate_call_id"] += int(dup_traj.sum())
    q_reason = np.empty(rows.n, dtype=object)
    q_reason[row_bad] = reasons[t[row_bad]]
    for row in np.flatnonzero(copy_only).tolist():
        q_reason[row] = f"duplicate_call_id: call {ci[row]} is an extra copy of an identical first-written row"

    row_reward = pa.array(rewards.value[t], pa.float64(), mask=rewards.null[t])
    keep = rows.primary & ~row_bad
    q_rows = np.flatnonzero(row_bad | copy_only)
    return RowVerdict(rows.calls, row_reward, keep, q_rows, q_reason[q_rows].tolist(), counts, t, rows.traj_ids, ci)


@dataclass
class RowVerdict:
    """Per row of the prepared calls: kept or quarantined (and why), with the trajectory codes."""

    calls: pa.Table  # prepared input (CALL_SCHEMA columns)
    row_reward: pa.Array  # float64 per row (null when missing)
    keep: np.ndarray  # bool per row: first copy of a call of a valid (included) trajectory
    q_rows: np.ndarray  # quarantined row indices, ascending
    q_reasons: list[str]  # reason per quarantined row
    counts: dict[str, int]
    t: np.ndarray  # trajectory code per row
    traj_ids: list[str]  # code -> trajectory_id
    ci: np.ndarray  # call_index per row (-1 for null)

    def valid_table(self, rows: np.ndarray | None = None) -> pa.Table:
        """Valid rows (``rows``: chosen row indices; default: all kept rows in input order)."""
        table = self.calls.append_column("reward", self.row_reward)
        if rows is not None:
            table = table.take(pa.array(rows, pa.int64()))
        elif not self.keep.all():
            table = table.filter(pa.array(self.keep))
        return pa.Table.from_arrays(table.columns, schema=VALID_SCHEMA)

    def quarantine_table(self) -> pa.Table:
        rows = pa.array(self.q_rows, pa.int64())
        q = self.calls.take(rows)
        q = q.append_column("quarantine_reason", pa.array(self.q_reasons, pa.string()))
        q = q.append_column("reward", self.row_reward.take(rows))
        return pa.Table.from_arrays(q.columns, schema=QUARANTINE_SCHEMA)

    def n_quarantined_trajectories(self) -> int:
        return int(sum(self.counts.values()))

    def rejected_trajectory_ids(self) -> list[str]:
        """Trajectories rejected as a whole (sorted)."""
        rejected = np.setdiff1d(np.unique(self.t[self.q_rows]), np.unique(self.t[self.keep]))
        return sorted(self.traj_ids[i] for i in rejected.tolist())

    def result(self) -> ValidationResult:
        return ValidationResult(valid=self.valid_table(), quarantined=self.quarantine_table(), counts=self.counts)
