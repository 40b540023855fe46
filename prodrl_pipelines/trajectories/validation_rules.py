"""The validation rules, one function per concern; ``validation`` applies them in its order.

A rule is a triple (reason code, bad mask over rows, ``describe(row)`` -> detail) over a prepared
calls table. The masks are vectorised over flattened Arrow list buffers with numpy (fast paths skip
the per-value masks when a column's min/max or sum shows it clean); ``describe`` runs only for the
row that quarantines a trajectory, so Python loops stay off the clean path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.trajectories.schema import CALL_SCHEMA
from prodrl_pipelines.trajectories.store import latest_rewards

Rule = tuple[str, np.ndarray, Callable[[int], str]]
# (bad position per row, -1 when none; detail(row, position) naming the value)
_Check = tuple[np.ndarray, Callable[[int, int], str]]

# ----------------------------------------------------------------------------- flattened list columns


def one_chunk(col: pa.ChunkedArray) -> pa.Array:
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


def _item(calls: pa.Table, col: str, row: int, p: int):
    """Value ``p`` of a list column's row."""
    return calls.column(col)[row].values[p].as_py()


def _nested_item(calls: pa.Table, col: str, row: int, r: int, p: int):
    """Value ``p`` of inner list ``r`` of a list-of-lists column's row."""
    return calls.column(col)[row].values[r].values[p].as_py()


# ----------------------------------------------------------------------------- the rows the rules read


class CallRows:
    """A prepared, non-empty calls table with what every rule reads: per row its trajectory code
    ``t`` and call index ``ci`` (-1 for null), ``primary`` (the first copy of its call) and
    ``dup_copy`` (an extra copy), both limited to ``include``; list columns flattened once."""

    def __init__(self, calls: pa.Table, include: np.ndarray | None) -> None:
        self.calls = calls
        self.n = calls.num_rows
        enc = pc.dictionary_encode(pc.fill_null(self.col("trajectory_id"), ""))
        self.t = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        self.traj_dictionary = enc.dictionary
        self.traj_ids = enc.dictionary.to_pylist()
        self.n_traj = len(self.traj_ids)
        ci_arr = self.col("call_index")
        self.ci_null = ci_arr.is_null().to_numpy(zero_copy_only=False)
        self.ci = pc.fill_null(ci_arr, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        key = (self.t << 32) | (self.ci & 0xFFFFFFFF)
        _, self.first_idx, inverse = np.unique(key, return_index=True, return_inverse=True)
        self.inverse = inverse.reshape(-1)
        self.primary = np.zeros(self.n, dtype=bool)
        self.primary[self.first_idx] = True
        self.dup_copy = ~self.primary
        if include is not None:
            self.primary &= include
            self.dup_copy &= include
        self._flat: dict[str, _Flat] = {}
        self._inner: dict[str, _Flat] = {}

    def col(self, name: str) -> pa.Array:
        return one_chunk(self.calls.column(name))

    def flat(self, name: str) -> _Flat:
        """A list column flattened (built on first use: several rules read the same columns)."""
        if name not in self._flat:
            self._flat[name] = _Flat(self.col(name))
        return self._flat[name]

    def inner(self, name: str) -> _Flat:
        """The inner lists of a list-of-lists column (the top-K rows of every call), flattened."""
        if name not in self._inner:
            self._inner[name] = _Flat(self.flat(name).values)
        return self._inner[name]


# ----------------------------------------------------------------------------- the rules


def duplicate_rule(rows: CallRows) -> Rule:
    """duplicate_call_id: a call recorded more than once with different content (``created_at`` ignored)."""
    t, ci = rows.t, rows.ci
    conflict_traj = np.zeros(rows.n_traj, dtype=bool)
    conflict_call = np.full(rows.n_traj, -1, dtype=np.int64)
    conflict_times = np.zeros(rows.n_traj, dtype=np.int64)
    if rows.dup_copy.any():
        # Compare every extra copy with the first copy of its call, column by column (NaN == NaN).
        copies = np.flatnonzero(rows.dup_copy)
        firsts = rows.first_idx[rows.inverse[copies]]
        same = np.ones(len(copies), dtype=bool)
        for name in CALL_SCHEMA.names:
            if name == "created_at":
                continue
            col = rows.col(name)
            same &= _rows_equal(col.take(pa.array(copies)), col.take(pa.array(firsts)))
        groups_copies = np.bincount(rows.inverse[copies], minlength=len(rows.first_idx))
        for row in np.unique(firsts[~same]).tolist():
            tt = t[row]
            if not conflict_traj[tt] or ci[row] < conflict_call[tt]:
                conflict_traj[tt] = True
                conflict_call[tt] = ci[row]
                conflict_times[tt] = groups_copies[rows.inverse[row]] + 1

    def describe(row: int) -> str:
        tt = t[row]
        return f"call {conflict_call[tt]} recorded {conflict_times[tt]} times with different content"

    return "duplicate_call_id", conflict_traj[t], describe


def crossed_rule(rows: CallRows, crossed: Mapping[str, str] | None) -> Rule:
    """crossed_versions: a call of the trajectory outside the policy window can never enter it
    (``crossing.classify``: trajectory -> detail)."""
    crossed = crossed or {}
    traj_bad = np.array([tid in crossed for tid in rows.traj_ids], dtype=bool)

    def describe(row: int) -> str:
        return crossed[rows.traj_ids[rows.t[row]]]

    return "crossed_versions", traj_bad[rows.t], describe


def call_index_rule(rows: CallRows) -> Rule:
    """bad_call_index: a trajectory's call indices (first copies) are not exactly 0..n-1, or null."""
    t, ci, n_traj = rows.t, rows.ci, rows.n_traj
    pt = t[rows.primary]
    pci = ci[rows.primary]
    n_calls = np.bincount(pt, minlength=n_traj)
    min_ci = np.full(n_traj, np.iinfo(np.int64).max)
    max_ci = np.full(n_traj, np.iinfo(np.int64).min)
    np.minimum.at(min_ci, pt, pci)
    np.maximum.at(max_ci, pt, pci)
    any_null_ci = np.zeros(n_traj, dtype=bool)
    any_null_ci[t[rows.ci_null]] = True
    null_tid = np.zeros(n_traj, dtype=bool)
    null_tid[t[rows.col("trajectory_id").is_null().to_numpy(zero_copy_only=False)]] = True
    bad = (min_ci != 0) | (max_ci != n_calls - 1) | any_null_ci | null_tid
    by_traj: list[np.ndarray] = []  # rows grouped by trajectory, built on first use

    def describe(row: int) -> str:
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

    return "bad_call_index", bad[t], describe


def policy_version_rule(rows: CallRows, known_versions: Collection[str]) -> Rule:
    """unknown_policy_version: a call's policy_version is not one of ``known_versions``."""
    pv = pc.fill_null(rows.col("policy_version"), "")
    known = pa.array(sorted(set(known_versions)), pa.string())
    unknown = ~pc.is_in(pv, value_set=known).to_numpy(zero_copy_only=False)

    def describe(row: int) -> str:
        version = rows.col("policy_version")[row].as_py()
        return f"call {rows.ci[row]} policy_version={version!r} is not a known version"

    return "unknown_policy_version", unknown, describe


def length_rules(rows: CallRows, check_prompt: bool) -> list[Rule]:
    """empty_generation, empty_prompt (with ``check_prompt``) and length_mismatch: the list lengths."""
    ci = rows.ci
    out = rows.flat("output_token_ids")
    empty = out.null | (out.length == 0)
    rules: list[Rule] = [
        ("empty_generation", empty,
         lambda row: f"call {ci[row]} output_token_ids is {'null' if out.null[row] else 'empty'}"),
    ]
    if check_prompt:
        prompt = rows.flat("prompt_token_ids")
        rules.append(("empty_prompt", prompt.null | (prompt.length == 0),
                      lambda row: f"call {ci[row]} prompt_token_ids is {'null' if prompt.null[row] else 'empty'}"))
    lps = rows.flat("output_logprobs")
    mismatch = ~empty & (lps.null | (lps.length != out.length))
    rules.append((
        "length_mismatch",
        mismatch,
        lambda row: (
            f"call {ci[row]} output_token_ids has {out.length[row]} tokens but output_logprobs "
            + ("is null" if lps.null[row] else f"has {lps.length[row]}")
        ),
    ))
    return rules


def token_id_rule(rows: CallRows, vocab_size: int, check_top: bool, check_prompt: bool) -> Rule:
    """token_id_out_of_range: an output, top-K or prompt token id null or outside [0, vocab_size)."""

    def out_of_range(values: pa.Array) -> np.ndarray:
        return _int_bad_idx(values, vocab_size)

    checks = [_list_check(rows, "output_token_ids", out_of_range)]
    if check_top:
        checks.append(_nested_check(rows, "top_token_ids", out_of_range))
    if check_prompt:
        checks.append(_list_check(rows, "prompt_token_ids", out_of_range))
    return _first_flagged("token_id_out_of_range", rows, checks, f" outside [0, {vocab_size})")


def logprob_rule(rows: CallRows, check_top: bool) -> Rule:
    """non_finite_logprob: an output or top-K logprob null, NaN or infinite."""
    checks = [_list_check(rows, "output_logprobs", _float_bad_idx)]
    if check_top:
        checks.append(_nested_check(rows, "top_logprobs", _float_bad_idx))
    return _first_flagged("non_finite_logprob", rows, checks)


GREEDY_EPS = 1e-5  # the recorder's: a temperature below it is greedy decoding, not a sample


def sampling_rule(rows: CallRows) -> Rule:
    """bad_sampling: a temperature null, non-finite or below ``GREEDY_EPS`` (the trainer divides the
    logits by it), or a top_p outside (0, 1]: no sampled distribution to correct towards."""
    t = pc.fill_null(pc.cast(rows.col("temperature"), pa.float64()), np.nan).to_numpy(zero_copy_only=False)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(t) | (t < GREEDY_EPS)
    if "top_p" in rows.calls.column_names:
        tp = pc.cast(rows.col("top_p"), pa.float64())
        v = pc.fill_null(tp, 1.0).to_numpy(zero_copy_only=False)
        with np.errstate(invalid="ignore"):
            bad |= ~np.isfinite(v) | (v <= 0) | (v > 1)

    def describe(row: int) -> str:
        temp, top_p = rows.col("temperature")[row].as_py(), None
        if "top_p" in rows.calls.column_names:
            top_p = rows.col("top_p")[row].as_py()
        return f"call {rows.ci[row]} temperature={temp!r} top_p={top_p!r} is not a sampled distribution"

    return "bad_sampling", bad, describe


def _list_check(rows: CallRows, name: str, find_bad: Callable[[pa.Array], np.ndarray]) -> _Check:
    """Per row: the first flagged value of a list column."""
    flat = rows.flat(name)
    return flat.first_bad(find_bad(flat.values)), lambda row, p: f"{name}[{p}]={_item(rows.calls, name, row, p)}"


def _nested_check(rows: CallRows, name: str, find_bad: Callable[[pa.Array], np.ndarray]) -> _Check:
    """Per row: the first inner list (top-K row) of a list-of-lists column holding a flagged value."""
    outer, inner = rows.flat(name), rows.inner(name)
    inner_pos = inner.first_bad(find_bad(inner.values))  # per top row
    bad_row = outer.first_bad(np.flatnonzero(inner_pos >= 0))  # per call: first bad top row

    def detail(row: int, r: int) -> str:
        p = int(inner_pos[outer.start[row] + r])
        return f"{name}[{r}][{p}]={_nested_item(rows.calls, name, row, r, p)}"

    return bad_row, detail


def _first_flagged(code: str, rows: CallRows, checks: list[_Check], suffix: str = "") -> Rule:
    """A rule failing a row that any check flags; the detail names the first check's value."""
    bad = np.zeros(rows.n, dtype=bool)
    for pos, _ in checks:
        bad |= pos >= 0

    def describe(row: int) -> str:
        for pos, detail in checks:
            if pos[row] >= 0:
                return f"call {rows.ci[row]} {detail(row, int(pos[row]))}{suffix}"
        return f"call {rows.ci[row]}"

    return code, bad, describe


def top_k_shape_rule(rows: CallRows) -> Rule:
    """top_k_shape: top-K rows not one per output token, shorter than K, K = 0, or K differing per column."""
    ci, out = rows.ci, rows.flat("output_token_ids")
    shapes = []
    for name in ("top_token_ids", "top_logprobs"):
        outer, inner = rows.flat(name), rows.inner(name)
        row_len = np.where(inner.null, -1, inner.length)  # per top row
        k = _group_reduce(row_len, outer.length, outer.start, np.maximum, 0)
        k_min = _group_reduce(row_len, outer.length, outer.start, np.minimum, 0)
        count_bad = outer.null | (outer.length != out.length)
        short_pos = outer.first_bad(np.flatnonzero(row_len < np.repeat(k, outer.length)))
        shapes.append((name, outer, row_len, k, k_min, count_bad, short_pos))
    bad = np.zeros(rows.n, dtype=bool)
    for _, _, _, k, k_min, count_bad, _ in shapes:
        bad |= count_bad | (k_min != k) | (k < 1)
    bad |= shapes[0][3] != shapes[1][3]

    def describe(row: int) -> str:
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

    return "top_k_shape", bad, describe


def routing_rule(rows: CallRows, routing_shape: tuple[int, int, int] | None = None) -> Rule:
    """bad_routing: recorded MoE routing that cannot be decoded, does not cover the call's forwarded
    positions, repeats an expert within a position, or (with ``routing_shape`` = the policy's (MoE
    layers, experts per token, experts)) does not fit the model. Calls without routing pass."""
    from prodrl_pipelines.trajectories.routing import ROUTING_COLUMN, ROUTING_START_COLUMN, RoutingError, check_fits, decode_routing

    bad = np.zeros(rows.n, dtype=bool)
    why: dict[int, str] = {}
    if ROUTING_COLUMN not in rows.calls.column_names:
        return "bad_routing", bad, lambda row: ""
    blobs = rows.col(ROUTING_COLUMN)
    present = np.flatnonzero(~blobs.is_null().to_numpy(zero_copy_only=False))
    if len(present):
        starts = pc.fill_null(rows.col(ROUTING_START_COLUMN), 0).to_numpy(zero_copy_only=False)
        n_prompt, n_out = rows.flat("prompt_token_ids").length, rows.flat("output_token_ids").length
        layers, k, experts = routing_shape or (None, None, None)
        for row in present.tolist():
            try:
                problem = check_fits(decode_routing(blobs[row].as_py()), int(n_prompt[row]), int(n_out[row]),
                                     int(starts[row]), layers, k, experts)
            except RoutingError as exc:
                problem = str(exc)
            if problem:
                bad[row] = True
                why[row] = problem
    ci = rows.ci
    return "bad_routing", bad, lambda row: f"call {ci[row]} routed_experts: {why.get(row, '')}"


@dataclass(frozen=True)
class TrajectoryRewards:
    """Per trajectory code: whether it has a reward row, its latest reward (NaN when none), null or not."""

    has_row: np.ndarray
    value: np.ndarray
    null: np.ndarray


def trajectory_rewards(rows: CallRows, rewards: pa.Table) -> TrajectoryRewards:
    """The latest reward of each trajectory of ``rows`` (``store.latest_rewards``)."""
    rw = latest_rewards(rewards.filter(pc.is_valid(rewards.column("trajectory_id"))))
    pos_in_rw = pc.fill_null(pc.index_in(rows.traj_dictionary, value_set=rw.column("trajectory_id")), -1)
    pos_in_rw = pos_in_rw.to_numpy(zero_copy_only=False).astype(np.int64)
    has_row = pos_in_rw >= 0
    value = np.full(rows.n_traj, np.nan)
    null = np.ones(rows.n_traj, dtype=bool)
    if has_row.any():
        idx = pos_in_rw[has_row].astype(np.int64)
        rcol = rw.column("reward").combine_chunks()
        value[has_row] = rcol.to_numpy(zero_copy_only=False)[idx]
        null[has_row] = rcol.is_null().to_numpy(zero_copy_only=False)[idx]
    return TrajectoryRewards(has_row, value, null)


def reward_rules(rows: CallRows, rewards: TrajectoryRewards) -> list[Rule]:
    """missing_reward (no reward row, or a null reward) and non_finite_reward (NaN or infinite)."""
    t = rows.t
    non_finite = ~rewards.null & ~np.isfinite(rewards.value)
    return [
        ("missing_reward", rewards.null[t],
         lambda row: "no reward row for the trajectory" if not rewards.has_row[t[row]] else "reward is null"),
        ("non_finite_reward", non_finite[t], lambda row: f"reward={rewards.value[t[row]]}"),
    ]
