"""Record validation: split recorded calls into trainable trajectories and quarantined rows.

Rules (DESIGN.md section 3), checked in this order; a trajectory is quarantined with the FIRST rule
that fails on any of its calls (the reason names the lowest failing call index and the field):

==========================  ===================================================================
reason code                 failing condition
==========================  ===================================================================
duplicate_call_id           a (trajectory_id, call_index) recorded more than once with different
                            content (``created_at`` ignored). Identical copies only quarantine the
                            extra copies; the first copy in table order is kept.
bad_call_index              the call indices of a trajectory are not exactly 0..n-1 (or null)
unknown_policy_version      policy_version not in ``known_versions``
empty_generation            output_token_ids null or empty
empty_prompt                prompt_token_ids null or empty (the first output token has no context
                            to be predicted from)
length_mismatch             len(output_logprobs) != len(output_token_ids)
token_id_out_of_range       a prompt, output or top-K token id null or outside [0, vocab_size)
non_finite_logprob          an output or top-K logprob null, NaN or +-inf
top_k_shape                 top_token_ids / top_logprobs row count != number of output tokens, or
                            a row shorter than K (K = longest row of that call, per column), K = 0,
                            or K differs between top_token_ids and top_logprobs
missing_reward              no reward row, or a null reward
non_finite_reward           reward NaN or +-inf
==========================  ===================================================================

Everything is vectorised over flattened Arrow list buffers with numpy (fast paths skip the per-value
masks when a column's min/max or sum shows it clean); Python loops run only over quarantined
trajectories and extra duplicate copies, to build reason strings.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.trajectories.schema import CALL_SCHEMA, QUARANTINE_SCHEMA, REWARD_SCHEMA
from prodrl_pipelines.trajectories.store import latest_rewards

REASONS: tuple[str, ...] = (
    "duplicate_call_id",
    "bad_call_index",
    "unknown_policy_version",
    "empty_generation",
    "empty_prompt",
    "length_mismatch",
    "token_id_out_of_range",
    "non_finite_logprob",
    "top_k_shape",
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
    return _validate(calls, rewards, vocab_size, known_versions, check_top=True, check_prompt=True).result()


# ----------------------------------------------------------------------------- preparation


def _prepare(table: pa.Table, schema: pa.Schema, required: tuple[str, ...], what: str) -> pa.Table:
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
            arrays.append(_one_chunk(col))
        else:
            arrays.append(pa.nulls(table.num_rows, f.type))
    # Nullable copy of the schema: nulls in key columns are data problems, handled by the rules.
    return pa.Table.from_arrays(arrays, schema=pa.schema([pa.field(f.name, f.type) for f in schema]))


def _one_chunk(col: pa.ChunkedArray) -> pa.Array:
    """The column as one Array (no copy when it already is one chunk)."""
    if col.num_chunks == 1:
        return col.chunk(0)
    return col.combine_chunks()


class _Flat:
    """A list column flattened one level: values, start of each row in them, lengths (null -> 0)."""

    def __init__(self, arr: pa.Array) -> None:
        self.n = len(arr)
        self.null = arr.is_null().to_numpy(zero_copy_only=False)
        lengths = pc.list_value_length(arr)
        self.length = pc.fill_null(lengths, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        self.values = arr.flatten()
        self.start = np.zeros(self.n, dtype=np.int64)
        if self.n:
            np.cumsum(self.length[:-1], out=self.start[1:])

    def rows_of(self, idx: np.ndarray) -> np.ndarray:
        """Row holding each flattened value index (empty rows share a start; the last one holds it)."""
        return np.searchsorted(self.start, idx, side="right") - 1

    def first_bad(self, bad_idx: np.ndarray) -> np.ndarray:
        """Per row: position in the row of its first flagged value (-1 when none). ``bad_idx``:
        ascending flattened indices of flagged values."""
        out = np.full(self.n, -1, dtype=np.int64)
        if len(bad_idx):
            rows, first = np.unique(self.rows_of(bad_idx), return_index=True)
            out[rows] = bad_idx[first] - self.start[rows]
        return out


_NONE = np.zeros(0, dtype=np.int64)


def _int_bad_idx(values: pa.Array, vocab_size: int) -> np.ndarray:
    """Flattened indices of token ids that are null or outside [0, vocab_size)."""
    if len(values) == 0:
        return _NONE
    if values.null_count == 0:
        mm = pc.min_max(values).as_py()
        if mm["min"] >= 0 and mm["max"] < vocab_size:
            return _NONE  # fast path: one pass, no mask
    v = pc.fill_null(values, -1).to_numpy(zero_copy_only=False)
    return np.flatnonzero((v < 0) | (v >= vocab_size))


def _float_bad_idx(values: pa.Array) -> np.ndarray:
    """Flattened indices of logprobs that are null, NaN or infinite."""
    if len(values) == 0:
        return _NONE
    v = values.to_numpy(zero_copy_only=False)  # nulls -> NaN
    if values.null_count == 0 and np.isfinite(np.sum(v, dtype=np.float64)):
        return _NONE  # a float64 sum of float32 values cannot overflow: finite <=> all finite
    return np.flatnonzero(~np.isfinite(v))


def _rows_equal(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Element-wise equality of two same-typed arrays, recursing into lists; null == null, NaN == NaN."""
    a_null = a.is_null().to_numpy(zero_copy_only=False)
    b_null = b.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_list(a.type) or pa.types.is_large_list(a.type):
        la, lb = _Flat(a), _Flat(b)
        eq = (a_null == b_null) & (la.length == lb.length)
        idx = np.flatnonzero(eq & (la.length > 0))
        if len(idx):
            ia = pa.array(idx)
            fa, fb = _Flat(a.take(ia)), _Flat(b.take(ia))
            child = _rows_equal(fa.values, fb.values)
            eq[idx] &= np.logical_and.reduceat(child, fa.start)
        return eq
    eq = pc.fill_null(pc.equal(a, b), False).to_numpy(zero_copy_only=False)
    if pa.types.is_floating(a.type):
        both_nan = pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False).to_numpy(zero_copy_only=False)
        eq = eq | both_nan
    return eq | (a_null & b_null)


def _group_reduce(values: np.ndarray, lengths: np.ndarray, start: np.ndarray, fn, empty) -> np.ndarray:
    """Per-row reduction of the flattened ``values`` (``fn`` a numpy ufunc); ``empty`` for empty rows."""
    out = np.full(len(lengths), empty, dtype=np.int64)
    nz = np.flatnonzero(lengths > 0)
    if len(nz):
        out[nz] = fn.reduceat(values, start[nz])
    return out


# ----------------------------------------------------------------------------- the rules


def _validate(
    calls: pa.Table,
    rewards: pa.Table,
    vocab_size: int,
    known_versions: Collection[str],
    *,
    check_top: bool,
    check_prompt: bool,
    include: np.ndarray | None = None,
) -> _Verdict:
    """Row-level verdict without materialising the valid table. ``include``: optional row mask;
    rows outside it (whole trajectories, e.g. already used) are ignored: neither valid nor quarantined."""
    required = [
        c
        for c in REQUIRED_CALL_COLUMNS
        if (check_top or not c.startswith("top_")) and (check_prompt or c != "prompt_token_ids")
    ]
    calls = _prepare(calls, CALL_SCHEMA, tuple(required), "calls")
    rewards = _prepare(rewards, REWARD_SCHEMA, REQUIRED_REWARD_COLUMNS, "rewards")
    n = calls.num_rows
    counts = {r: 0 for r in REASONS}

    def _col(name: str) -> pa.Array:
        return _one_chunk(calls.column(name))

    if n == 0:
        e = np.zeros(0, dtype=np.int64)
        return _Verdict(calls, pa.nulls(0, pa.float64()), np.zeros(0, bool), e, [], counts, e, [], e)

    # --- identities --------------------------------------------------------------------------
    tid = pc.fill_null(_col("trajectory_id"), "")
    enc = pc.dictionary_encode(tid)
    t = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    traj_ids = enc.dictionary.to_pylist()
    n_traj = len(traj_ids)
    ci_arr = _col("call_index")
    ci_null = ci_arr.is_null().to_numpy(zero_copy_only=False)
    ci = pc.fill_null(ci_arr, -1).to_numpy(zero_copy_only=False).astype(np.int64)

    # --- duplicates --------------------------------------------------------------------------
    key = (t << 32) | (ci & 0xFFFFFFFF)
    _, first_idx, inverse = np.unique(key, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    primary = np.zeros(n, dtype=bool)
    primary[first_idx] = True
    dup_copy = ~primary
    if include is not None:
        primary &= include
        dup_copy &= include
    conflict_traj = np.zeros(n_traj, dtype=bool)
    conflict_call = np.full(n_traj, -1, dtype=np.int64)
    conflict_times = np.zeros(n_traj, dtype=np.int64)
    if dup_copy.any():
        # Compare every extra copy with the first copy of its call, column by column (NaN == NaN).
        copies = np.flatnonzero(dup_copy)
        firsts = first_idx[inverse[copies]]
        same = np.ones(len(copies), dtype=bool)
        for name in CALL_SCHEMA.names:
            if name == "created_at":
                continue
            col = _col(name)
            same &= _rows_equal(col.take(pa.array(copies)), col.take(pa.array(firsts)))
        groups_copies = np.bincount(inverse[copies], minlength=len(first_idx))
        for row in np.unique(firsts[~same]).tolist():
            tt = t[row]
            if not conflict_traj[tt] or ci[row] < conflict_call[tt]:
                conflict_traj[tt] = True
                conflict_call[tt] = ci[row]
                conflict_times[tt] = groups_copies[inverse[row]] + 1

    # --- per-trajectory call index check on primary rows --------------------------------------
    pt = t[primary]
    pci = ci[primary]
    n_calls = np.bincount(pt, minlength=n_traj)
    min_ci = np.full(n_traj, np.iinfo(np.int64).max)
    max_ci = np.full(n_traj, np.iinfo(np.int64).min)
    np.minimum.at(min_ci, pt, pci)
    np.maximum.at(max_ci, pt, pci)
    any_null_ci = np.zeros(n_traj, dtype=bool)
    any_null_ci[t[ci_null]] = True
    null_tid = np.zeros(n_traj, dtype=bool)
    null_tid[t[_col("trajectory_id").is_null().to_numpy(zero_copy_only=False)]] = True
    bad_index_traj = (min_ci != 0) | (max_ci != n_calls - 1) | any_null_ci | null_tid

    # --- per-row rules: (code, bad mask over rows, describe(row) -> detail) --------------------
    rules: list[tuple[str, np.ndarray, Callable[[int], str]]] = []

    def traj_rule(code: str, bad_traj: np.ndarray, describe: Callable[[int], str]) -> None:
        rules.append((code, bad_traj[t], describe))

    def _desc_conflict(row: int) -> str:
        tt = t[row]
        return f"call {conflict_call[tt]} recorded {conflict_times[tt]} times with different content"

    by_traj: list[np.ndarray] = []  # rows grouped by trajectory, built on first use

    def _desc_index(row: int) -> str:
        tt = t[row]
        if null_tid[tt]:
            return "trajectory_id is null"
        if not by_traj:
            order = np.argsort(t, kind="stable")
            bounds = np.concatenate([[0], np.cumsum(np.bincount(t, minlength=n_traj))])
            by_traj.extend([order, bounds])
        order, bounds = by_traj
        idx = sorted(set(ci[order[bounds[tt] : bounds[tt + 1]]].tolist()))
        shown = ", ".join("null" if i == -1 and any_null_ci[tt] else str(i) for i in idx[:10])
        more = ", ..." if len(idx) > 10 else ""
        return f"call indices [{shown}{more}] are not 0..{n_calls[tt] - 1}"

    traj_rule("duplicate_call_id", conflict_traj, _desc_conflict)
    traj_rule("bad_call_index", bad_index_traj, _desc_index)

    pv = pc.fill_null(_col("policy_version"), "")
    known = pa.array(sorted(set(known_versions)), pa.string())
    unknown = ~pc.is_in(pv, value_set=known).to_numpy(zero_copy_only=False)
    pv_list = None

    def _desc_version(row: int) -> str:
        nonlocal pv_list
        if pv_list is None:
            pv_list = _col("policy_version")
        return f"call {ci[row]} policy_version={pv_list[row].as_py()!r} is not a known version"

    rules.append(("unknown_policy_version", unknown, _desc_version))

    out = _Flat(_col("output_token_ids"))
    empty = out.null | (out.length == 0)
    rules.append(
        (
            "empty_generation",
            empty,
            lambda row: f"call {ci[row]} output_token_ids is {'null' if out.null[row] else 'empty'}",
        )
    )
    if check_prompt:
        prompt_ids = _Flat(_col("prompt_token_ids"))
        rules.append(("empty_prompt", prompt_ids.null | (prompt_ids.length == 0),
                      lambda row: f"call {ci[row]} prompt_token_ids is {'null' if prompt_ids.null[row] else 'empty'}"))

    lps = _Flat(_col("output_logprobs"))
    mismatch = ~empty & (lps.null | (lps.length != out.length))
    rules.append(
        (
            "length_mismatch",
            mismatch,
            lambda row: (
                f"call {ci[row]} output_token_ids has {out.length[row]} tokens but output_logprobs "
                + ("is null" if lps.null[row] else f"has {lps.length[row]}")
            ),
        )
    )

    # token ids in range
    id_checks: list[tuple[str, np.ndarray, Callable[[int, int], str]]] = []
    out_bad_pos = out.first_bad(_int_bad_idx(out.values, vocab_size))
    id_checks.append(
        ("output_token_ids", out_bad_pos, lambda row, p: f"output_token_ids[{p}]={_as_py(calls, 'output_token_ids', row, p)}")
    )
    if check_top:
        top_ids = _Flat(_col("top_token_ids"))
        top_ids_inner = _Flat(top_ids.values)
        inner_pos = top_ids_inner.first_bad(_int_bad_idx(top_ids_inner.values, vocab_size))  # per top row
        top_bad_row = top_ids.first_bad(np.flatnonzero(inner_pos >= 0))  # per call: first bad top row

        def _top_id_desc(row: int, r: int) -> str:
            flat_row = top_ids.start[row] + r
            p = int(inner_pos[flat_row])
            return f"top_token_ids[{r}][{p}]={_as_py2(calls, 'top_token_ids', row, r, p)}"

        id_checks.append(("top_token_ids", top_bad_row, _top_id_desc))
    if check_prompt:
        prompt = _Flat(_col("prompt_token_ids"))
        prompt_bad_pos = prompt.first_bad(_int_bad_idx(prompt.values, vocab_size))
        id_checks.append(
            (
                "prompt_token_ids",
                prompt_bad_pos,
                lambda row, p: f"prompt_token_ids[{p}]={_as_py(calls, 'prompt_token_ids', row, p)}",
            )
        )
    id_bad = np.zeros(n, dtype=bool)
    for _, pos, _ in id_checks:
        id_bad |= pos >= 0

    def _desc_ids(row: int) -> str:
        for _, pos, fmt in id_checks:
            if pos[row] >= 0:
                return f"call {ci[row]} {fmt(row, int(pos[row]))} outside [0, {vocab_size})"
        return f"call {ci[row]}"

    rules.append(("token_id_out_of_range", id_bad, _desc_ids))

    # finite logprobs
    lp_checks: list[tuple[np.ndarray, Callable[[int, int], str]]] = []
    lp_bad_pos = lps.first_bad(_float_bad_idx(lps.values))
    lp_checks.append(
        (lp_bad_pos, lambda row, p: f"output_logprobs[{p}]={_as_py(calls, 'output_logprobs', row, p)}")
    )
    if check_top:
        top_lps = _Flat(_col("top_logprobs"))
        top_lps_inner = _Flat(top_lps.values)
        lp_inner_pos = top_lps_inner.first_bad(_float_bad_idx(top_lps_inner.values))
        top_lp_bad_row = top_lps.first_bad(np.flatnonzero(lp_inner_pos >= 0))

        def _top_lp_desc(row: int, r: int) -> str:
            p = int(lp_inner_pos[top_lps.start[row] + r])
            return f"top_logprobs[{r}][{p}]={_as_py2(calls, 'top_logprobs', row, r, p)}"

        lp_checks.append((top_lp_bad_row, _top_lp_desc))
    lp_bad = np.zeros(n, dtype=bool)
    for pos, _ in lp_checks:
        lp_bad |= pos >= 0

    def _desc_lp(row: int) -> str:
        for pos, fmt in lp_checks:
            if pos[row] >= 0:
                return f"call {ci[row]} {fmt(row, int(pos[row]))}"
        return f"call {ci[row]}"

    rules.append(("non_finite_logprob", lp_bad, _desc_lp))

    # top-K shape
    if check_top:
        shapes = []
        for name, outer, inner in (("top_token_ids", top_ids, top_ids_inner), ("top_logprobs", top_lps, top_lps_inner)):
            row_len = np.where(inner.null, -1, inner.length)  # per top row
            k = _group_reduce(row_len, outer.length, outer.start, np.maximum, 0)
            k_min = _group_reduce(row_len, outer.length, outer.start, np.minimum, 0)
            count_bad = outer.null | (outer.length != out.length)
            short_pos = outer.first_bad(np.flatnonzero(row_len < np.repeat(k, outer.length)))
            shapes.append((name, outer, row_len, k, k_min, count_bad, short_pos))
        shape_bad = np.zeros(n, dtype=bool)
        for _, _, _, k, k_min, count_bad, _ in shapes:
            shape_bad |= count_bad | (k_min != k) | (k < 1)
        shape_bad |= shapes[0][3] != shapes[1][3]

        def _desc_shape(row: int) -> str:
            for name, outer, row_len, k, k_min, count_bad, short_pos in shapes:
                if count_bad[row]:
                    has = "is null" if outer.null[row] else f"has {outer.length[row]} rows"
                    return f"call {ci[row]} {name} {has} for {out.length[row]} output tokens"
                if k_min[row] != k[row]:
                    r = int(short_pos[row])
                    got = row_len[outer.start[row] + r]
                    got_s = "null" if got < 0 else f"{got} entries"
                    return f"call {ci[row]} {name}[{r}] has {got_s}, K={k[row]}"
                if k[row] < 1:
                    return f"call {ci[row]} {name} rows are empty (K=0)"
            return (
                f"call {ci[row]} top_token_ids rows have K={shapes[0][3][row]} "
                f"but top_logprobs rows have K={shapes[1][3][row]}"
            )

        rules.append(("top_k_shape", shape_bad, _desc_shape))

    # rewards
    rw = latest_rewards(rewards.filter(pc.is_valid(rewards.column("trajectory_id"))))
    traj_arr = enc.dictionary
    pos_in_rw = pc.fill_null(pc.index_in(traj_arr, value_set=rw.column("trajectory_id")), -1)
    pos_in_rw = pos_in_rw.to_numpy(zero_copy_only=False).astype(np.int64)
    has_row = pos_in_rw >= 0
    reward_np = np.full(n_traj, np.nan)
    reward_null = np.ones(n_traj, dtype=bool)
    if has_row.any():
        idx = pos_in_rw[has_row].astype(np.int64)
        rcol = rw.column("reward").combine_chunks()
        reward_np[has_row] = rcol.to_numpy(zero_copy_only=False)[idx]
        reward_null[has_row] = rcol.is_null().to_numpy(zero_copy_only=False)[idx]
    missing_reward = reward_null
    nonfinite_reward = ~reward_null & ~np.isfinite(reward_np)
    traj_rule(
        "missing_reward",
        missing_reward,
        lambda row: "no reward row for the trajectory" if not has_row[t[row]] else "reward is null",
    )
    traj_rule("non_finite_reward", nonfinite_reward, lambda row: f"reward={reward_np[t[row]]}")

    # --- first failing rule per trajectory (considering primary rows) -------------------------
    traj_code = np.full(n_traj, -1, dtype=np.int64)
    traj_row = np.full(n_traj, -1, dtype=np.int64)
    for code_i, (_, mask, _) in enumerate(rules):
        cand = np.flatnonzero(mask & primary & (traj_code[t] < 0))
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

    bad_traj = traj_code >= 0
    reasons = np.empty(n_traj, dtype=object)
    for tt in np.flatnonzero(bad_traj).tolist():
        code, _, describe = rules[traj_code[tt]]
        reasons[tt] = f"{code}: {describe(int(traj_row[tt]))}"
        counts[code] += 1

    row_bad = bad_traj[t]
    copy_only = dup_copy & ~row_bad  # extra identical copies of calls of otherwise-kept trajectories
    dup_traj = np.zeros(n_traj, dtype=bool)
    dup_traj[t[copy_only]] = True
    counts["duplicate_call_id"] += int(dup_traj.sum())
    q_reason = np.empty(n, dtype=object)
    q_reason[row_bad] = reasons[t[row_bad]]
    for row in np.flatnonzero(copy_only).tolist():
        q_reason[row] = f"duplicate_call_id: call {ci[row]} is an extra copy of an identical first-written row"

    row_reward = pa.array(reward_np[t], pa.float64(), mask=reward_null[t])

    keep = primary & ~row_bad
    q_rows = np.flatnonzero(row_bad | copy_only)
    return _Verdict(calls, row_reward, keep, q_rows, q_reason[q_rows].tolist(), counts, t, traj_ids, ci)


@dataclass
class _Verdict:
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


def _as_py(calls: pa.Table, col: str, row: int, p: int):
    return calls.column(col)[row].values[p].as_py()


def _as_py2(calls: pa.Table, col: str, row: int, r: int, p: int):
    return calls.column(col)[row].values[r].values[p].as_py()
