"""Validation rules (one hand-built bad record each), reason strings, counts, and round selection."""

from __future__ import annotations

import math
import random

import numpy as np
import pyarrow as pa
import pytest
from helpers import VOCAB, make_call, make_reward, make_trajectory

from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.schema import CALL_SCHEMA, QUARANTINE_SCHEMA, REWARD_SCHEMA
from prodrl_pipelines.trajectories.selection import InsufficientDataError, count_eligible, select_round_dataset
from prodrl_pipelines.trajectories.rows import policy_window
from prodrl_pipelines.trajectories.store import TrajectoryStore
from prodrl_pipelines.trajectories.validation import REASONS, VALID_SCHEMA, validate_trajectories

KNOWN = {"v0", "v1", "v2"}


def _tables(rows, rewards):
    return pa.Table.from_pylist(rows, schema=CALL_SCHEMA), pa.Table.from_pylist(rewards, schema=REWARD_SCHEMA)


def _dataset(n_good=3, n_calls=3):
    rows, rewards = [], []
    for i in range(n_good):
        tid = f"good{i}"
        rows += make_trajectory(tid, n_calls, minutes=i)
        rewards.append(make_reward(tid, float(i)))
    return rows, rewards


def _validate(rows, rewards):
    calls, rw = _tables(rows, rewards)
    return validate_trajectories(calls, rw, VOCAB, KNOWN)


def test_clean_data_all_valid_with_reward_joined():
    rows, rewards = _dataset()
    res = _validate(rows, rewards)
    assert res.valid.schema == VALID_SCHEMA
    assert res.valid.num_rows == 9 and res.quarantined.num_rows == 0
    assert res.quarantined.schema == QUARANTINE_SCHEMA
    assert set(res.counts) == set(REASONS) and sum(res.counts.values()) == 0
    by_traj = dict(zip(res.valid.column("trajectory_id").to_pylist(), res.valid.column("reward").to_pylist()))
    assert by_traj == {"good0": 0.0, "good1": 1.0, "good2": 2.0}
    assert res.n_valid_trajectories == 3


def _set(call, field, index, value):
    call[field] = list(call[field])
    call[field][index] = value


def _set2(call, field, i, j, value):
    call[field] = [list(r) for r in call[field]]
    call[field][i][j] = value


# (mutation of trajectory "bad" (3 calls, 4 tokens, K=3) and its reward, code, expected reason text)
CASES = {
    "output_id_too_big": (lambda c, r: _set(c[1], "output_token_ids", 2, VOCAB), "token_id_out_of_range",
                          "call 1 output_token_ids[2]=50 outside [0, 50)"),
    "output_id_negative": (lambda c, r: _set(c[0], "output_token_ids", 0, -1), "token_id_out_of_range",
                           "call 0 output_token_ids[0]=-1 outside [0, 50)"),
    "prompt_id_bad": (lambda c, r: _set(c[2], "prompt_token_ids", 4, 10**6), "token_id_out_of_range",
                      "call 2 prompt_token_ids[4]=1000000 outside [0, 50)"),
    "top_id_bad": (lambda c, r: _set2(c[1], "top_token_ids", 3, 1, VOCAB + 7), "token_id_out_of_range",
                   "call 1 top_token_ids[3][1]=57 outside [0, 50)"),
    "output_lp_nan": (lambda c, r: _set(c[1], "output_logprobs", 3, math.nan), "non_finite_logprob",
                      "call 1 output_logprobs[3]=nan"),
    "output_lp_null": (lambda c, r: _set(c[0], "output_logprobs", 1, None), "non_finite_logprob",
                       "call 0 output_logprobs[1]=None"),
    "top_lp_inf": (lambda c, r: _set2(c[2], "top_logprobs", 2, 1, -math.inf), "non_finite_logprob",
                   "call 2 top_logprobs[2][1]=-inf"),
    "greedy": (lambda c, r: c[1].update(temperature=0.0), "bad_sampling",
               "call 1 temperature=0.0 top_p=1.0 is not a sampled distribution"),
    "temperature_null": (lambda c, r: c[2].update(temperature=None), "bad_sampling",
                         "call 2 temperature=None top_p=1.0 is not a sampled distribution"),
    "temperature_nan": (lambda c, r: c[0].update(temperature=math.nan), "bad_sampling",
                        "call 0 temperature=nan top_p=1.0 is not a sampled distribution"),
    "top_p_zero": (lambda c, r: c[1].update(top_p=0.0), "bad_sampling",
                   "call 1 temperature=1.0 top_p=0.0 is not a sampled distribution"),
    "length_mismatch": (lambda c, r: c[1].update(output_logprobs=c[1]["output_logprobs"][:3]), "length_mismatch",
                        "call 1 output_token_ids has 4 tokens but output_logprobs has 3"),
    "logprobs_null": (lambda c, r: c[1].update(output_logprobs=None), "length_mismatch",
                      "call 1 output_token_ids has 4 tokens but output_logprobs is null"),
    "top_rows_count": (lambda c, r: c[2].update(top_token_ids=c[2]["top_token_ids"][:3]), "top_k_shape",
                       "call 2 top_token_ids has 3 rows for 4 output tokens"),
    "top_lp_rows_null": (lambda c, r: c[0].update(top_logprobs=None), "top_k_shape",
                         "call 0 top_logprobs is null for 4 output tokens"),
    "top_row_short": (lambda c, r: c[1].update(top_token_ids=[row if i != 2 else row[:2]
                                                               for i, row in enumerate(c[1]["top_token_ids"])]),
                      "top_k_shape", "call 1 top_token_ids[2] has 2 entries, K=3"),
    "top_k_disagree": (lambda c, r: c[0].update(top_logprobs=[row[:2] for row in c[0]["top_logprobs"]]),
                       "top_k_shape", "call 0 top_token_ids rows have K=3 but top_logprobs rows have K=2"),
    "top_rows_empty": (lambda c, r: c[0].update(top_token_ids=[[]] * 4, top_logprobs=[[]] * 4), "top_k_shape",
                       "call 0 top_token_ids rows are empty (K=0)"),
    "empty_generation": (lambda c, r: c[2].update(output_token_ids=[], output_logprobs=[], top_token_ids=[],
                                                  top_logprobs=[]), "empty_generation",
                         "call 2 output_token_ids is empty"),
    "null_generation": (lambda c, r: c[2].update(output_token_ids=None), "empty_generation",
                        "call 2 output_token_ids is null"),
    "empty_prompt": (lambda c, r: c[1].update(prompt_token_ids=[]), "empty_prompt", "call 1 prompt_token_ids is empty"),
    "null_prompt": (lambda c, r: c[0].update(prompt_token_ids=None), "empty_prompt", "call 0 prompt_token_ids is null"),
    "unknown_version": (lambda c, r: c[1].update(policy_version="v9"), "unknown_policy_version",
                        "call 1 policy_version='v9' is not a known version"),
    "reward_missing": (lambda c, r: r.clear(), "missing_reward", "no reward row for the trajectory"),
    "reward_null": (lambda c, r: r[0].update(reward=None), "missing_reward", "reward is null"),
    "reward_nan": (lambda c, r: r[0].update(reward=math.nan), "non_finite_reward", "reward=nan"),
    "reward_inf": (lambda c, r: r[0].update(reward=math.inf), "non_finite_reward", "reward=inf"),
    "call_index_gap": (lambda c, r: c[2].update(call_index=3), "bad_call_index",
                       "call indices [0, 1, 3] are not 0..2"),
    "call_index_from_1": (lambda c, r: [x.update(call_index=x["call_index"] + 1) for x in c], "bad_call_index",
                          "call indices [1, 2, 3] are not 0..2"),
    "duplicate_conflict": (lambda c, r: c.append(c[1] | {"output_text": "different"}), "duplicate_call_id",
                           "call 1 recorded 2 times with different content"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rule_quarantines_whole_trajectory(case):
    mutate, code, detail = CASES[case]
    rows, rewards = _dataset()
    bad_calls = make_trajectory("bad", 3, minutes=10)
    bad_rewards = [make_reward("bad", 1.0)]
    mutate(bad_calls, bad_rewards)
    res = _validate(rows + bad_calls, rewards + bad_rewards)
    # the rest survives intact
    assert sorted(set(res.valid.column("trajectory_id").to_pylist())) == ["good0", "good1", "good2"]
    assert res.valid.num_rows == 9
    # the whole bad trajectory is quarantined, with one reason naming the call and field
    q = res.quarantined
    assert set(q.column("trajectory_id").to_pylist()) == {"bad"}
    assert q.num_rows == len(bad_calls)
    reasons = set(q.column("quarantine_reason").to_pylist())
    assert reasons == {f"{code}: {detail}"}, reasons
    assert res.counts[code] == 1 and sum(res.counts.values()) == 1
    assert q.schema == QUARANTINE_SCHEMA


def test_identical_duplicate_copies_quarantined_first_kept():
    rows, rewards = _dataset(2)
    rows.append(dict(rows[1]))  # identical copy of good0 call 1
    rows.append(rows[4] | {"created_at": rows[4]["created_at"].replace(year=2030)})  # timestamp differs only
    res = _validate(rows, rewards)
    assert res.valid.num_rows == 6  # both trajectories kept, one row per call
    assert res.quarantined.num_rows == 2
    assert res.quarantined.column("quarantine_reason").to_pylist() == [
        "duplicate_call_id: call 1 is an extra copy of an identical first-written row"
    ] * 2
    assert res.counts["duplicate_call_id"] == 2
    assert res.quarantined_trajectory_ids == set()
    kept = [r for r in res.valid.to_pylist() if r["trajectory_id"] == "good1" and r["call_index"] == 1]
    assert kept[0]["created_at"].year == 2026  # the first copy


def test_first_failing_rule_and_lowest_call_reported():
    rows, rewards = _dataset(1)
    bad = make_trajectory("bad", 3)
    _set(bad[2], "output_token_ids", 0, VOCAB)  # token range, call 2
    _set(bad[1], "output_token_ids", 1, VOCAB)  # token range, call 1 (lower -> reported)
    _set(bad[0], "output_logprobs", 0, math.inf)  # non-finite (later rule than token range)
    bad[2]["output_logprobs"] = bad[2]["output_logprobs"][:1]  # length mismatch (earlier rule) on call 2
    res = _validate(rows + bad, rewards + [make_reward("bad")])
    assert set(res.quarantined.column("quarantine_reason").to_pylist()) == {
        "length_mismatch: call 2 output_token_ids has 4 tokens but output_logprobs has 1"
    }
    assert res.counts["length_mismatch"] == 1


def test_counts_over_many_trajectories():
    rows, rewards = _dataset(5)
    for i in range(3):
        t = make_trajectory(f"nan{i}", 2)
        _set(t[1], "output_logprobs", 0, math.nan)
        rows += t
        rewards.append(make_reward(f"nan{i}"))
    for i in range(2):
        rows += make_trajectory(f"norew{i}", 1)
    res = _validate(rows, rewards)
    assert res.counts["non_finite_logprob"] == 3
    assert res.counts["missing_reward"] == 2
    assert res.n_quarantined_trajectories == 5 and res.n_valid_trajectories == 5
    assert res.quarantined.num_rows == 3 * 2 + 2


def test_latest_reward_used_and_reward_column_in_quarantine():
    rows, _ = _dataset(1)
    rewards = [make_reward("good0", math.nan, minutes=0), make_reward("good0", 0.25, minutes=3)]
    res = _validate(rows, rewards)
    assert set(res.valid.column("reward").to_pylist()) == {0.25}


def test_missing_column_raises_naming_it():
    rows, rewards = _dataset(1)
    calls, rw = _tables(rows, rewards)
    with pytest.raises(ValueError, match="top_logprobs"):
        validate_trajectories(calls.drop_columns(["top_logprobs"]), rw, VOCAB, KNOWN)
    with pytest.raises(ValueError, match="reward"):
        validate_trajectories(calls, rw.drop_columns(["reward"]), VOCAB, KNOWN)
    # optional columns may be absent
    res = validate_trajectories(calls.drop_columns(["prompt_text", "created_at"]), rw, VOCAB, KNOWN)
    assert res.valid.num_rows == 3 and res.valid.schema == VALID_SCHEMA


def test_empty_input():
    res = validate_trajectories(CALL_SCHEMA.empty_table(), REWARD_SCHEMA.empty_table(), VOCAB, KNOWN)
    assert res.valid.num_rows == 0 and res.quarantined.num_rows == 0


# ----------------------------------------------------------------------------- randomized cross-check


def _reference_code(calls: list[dict], reward, vocab, known) -> str | None:
    """Plain-Python statement of the rules, in order."""
    by_idx: dict[int, list[dict]] = {}
    for c in calls:
        by_idx.setdefault(c["call_index"], []).append(c)

    def content(c):
        return repr(tuple(v for k, v in c.items() if k != "created_at"))

    if any(len({content(c) for c in cs}) > 1 for cs in by_idx.values()):
        return "duplicate_call_id"
    if sorted(by_idx) != list(range(len(by_idx))):
        return "bad_call_index"
    firsts = [by_idx[i][0] for i in sorted(by_idx)]

    def fin(x):
        return x is not None and math.isfinite(x)

    def ok_id(x):
        return x is not None and 0 <= x < vocab

    checks = [
        ("unknown_policy_version", lambda c: c["policy_version"] not in known),
        ("empty_generation", lambda c: not c["output_token_ids"]),
        ("length_mismatch", lambda c: c["output_logprobs"] is None or len(c["output_logprobs"]) != len(c["output_token_ids"])),
        ("token_id_out_of_range", lambda c: not all(map(ok_id, c["output_token_ids"] + (c["prompt_token_ids"] or [])
                                                            + [x for r in (c["top_token_ids"] or []) for x in (r or [])]))),
        ("non_finite_logprob", lambda c: not all(map(fin, (c["output_logprobs"] or [])
                                                     + [x for r in (c["top_logprobs"] or []) for x in (r or [])]))),
        ("bad_sampling", lambda c: not (fin(c["temperature"]) and c["temperature"] >= 1e-5)
         or (c["top_p"] is not None and not (math.isfinite(c["top_p"]) and 0 < c["top_p"] <= 1))),
        ("top_k_shape", lambda c: _bad_top(c)),
    ]
    for code, bad in checks:
        if any(bad(c) for c in firsts):
            return code
    if reward is None:
        return "missing_reward"
    if not math.isfinite(reward):
        return "non_finite_reward"
    return None


def _bad_top(c) -> bool:
    ks = []
    for name in ("top_token_ids", "top_logprobs"):
        rows = c[name]
        if rows is None or len(rows) != len(c["output_token_ids"]):
            return True
        lens = [len(r) if r is not None else -1 for r in rows]
        k = max(lens)
        if k < 1 or min(lens) != k:
            return True
        ks.append(k)
    return ks[0] != ks[1]


def _corrupt(rng: random.Random, call: dict) -> None:
    kind = rng.randrange(10)
    n = len(call["output_token_ids"])
    if kind == 0:
        _set(call, "output_token_ids", rng.randrange(n), rng.choice([VOCAB, -3]))
    elif kind == 1:
        _set(call, "output_logprobs", rng.randrange(n), rng.choice([math.nan, math.inf, None]))
    elif kind == 2:
        _set2(call, "top_logprobs", rng.randrange(n), 0, math.nan)
    elif kind == 3:
        call["output_logprobs"] = call["output_logprobs"][:-1]
    elif kind == 4:
        call["top_token_ids"] = call["top_token_ids"][:-1]
    elif kind == 5:
        call["policy_version"] = "v?"
    elif kind == 6:
        call["call_index"] += 5
    elif kind == 7:
        call.update(output_token_ids=[], output_logprobs=[], top_token_ids=[], top_logprobs=[])
    elif kind == 8:
        _set2(call, "top_token_ids", rng.randrange(n), 0, 10**5)
    else:
        call.update(rng.choice([{"temperature": 0.0}, {"temperature": None}, {"top_p": 0.0}, {"top_p": 1.5}]))


def test_vectorised_rules_match_reference_on_random_data():
    rng = random.Random(1234)
    rows, rewards, ref = [], [], {}
    for i in range(150):
        tid = f"t{i:03d}"
        calls = [make_call(tid, j, n_tokens=rng.randint(1, 5), k=rng.randint(1, 4), seed=i,
                           policy_version=rng.choice(["v0", "v1"])) for j in range(rng.randint(1, 3))]
        for c in calls:
            if rng.random() < 0.15:
                _corrupt(rng, c)
        if rng.random() < 0.1:
            calls.append(dict(calls[0]))
        if rng.random() < 0.05:
            calls.append(calls[0] | {"output_text": "other"})
        reward = rng.choice([1.0] * 8 + [math.nan, None])
        if reward is not None or rng.random() < 0.5:
            rewards.append(make_reward(tid, reward))
        rng.shuffle(calls)
        rows += calls
        ref[tid] = _reference_code(calls, reward, VOCAB, KNOWN)
    res = _validate(rows, rewards)
    got = {}
    for r in res.quarantined.to_pylist():
        code = r["quarantine_reason"].split(":")[0]
        if "extra copy" not in r["quarantine_reason"]:
            got[r["trajectory_id"]] = code
    assert got == {t: c for t, c in ref.items() if c is not None}
    assert set(res.valid.column("trajectory_id").to_pylist()) == {t for t, c in ref.items() if c is None}
    assert 10 < len(got) < 100  # the mix exercised both sides


# ----------------------------------------------------------------------------- selection


@pytest.fixture
def store(tmp_path):
    return TrajectoryStore(LocalBlobStore(tmp_path / "store"))


ORDER = ["v0", "v1", "v2"]


def _fill(store, version, names, minutes0=0, n_calls=2, reward=True):
    rows, rewards = [], []
    for i, name in enumerate(names):
        rows += make_trajectory(name, n_calls, minutes=minutes0 + i, policy_version=version)
        rewards.append(make_reward(name, 1.0))
    store.write_calls(rows)
    if reward:
        store.write_rewards(rewards)


def test_policy_window():
    assert policy_window("v2", ORDER, 0) == ["v2"]
    assert policy_window("v2", ORDER, 1) == ["v1", "v2"]
    assert policy_window("v0", ORDER, 5) == ["v0"]
    with pytest.raises(ValueError, match="v7"):
        policy_window("v7", ORDER, 0)


def test_selection_lag0_vs_lag1(store):
    _fill(store, "v1", ["old0", "old1"], minutes0=0)
    _fill(store, "v2", ["new0", "new1"], minutes0=10)
    sync = select_round_dataset(store, "round-a", "v2", ORDER, 0, 2, VOCAB, seed=0)
    assert sync.trajectory_ids == ["new0", "new1"] and sync.policy_versions == ["v2"]
    assert set(sync.dataset.column("policy_version").to_pylist()) == {"v2"}
    lagged = select_round_dataset(store, "round-b", "v2", ORDER, 1, 2, VOCAB, seed=0)
    assert lagged.trajectory_ids == ["old0", "old1"]  # new* are in round-a's ledger; old are oldest anyway


def test_selection_oldest_first_ties_by_id_and_dataset_order(store):
    _fill(store, "v0", ["b", "a", "c", "d"], minutes0=0)  # created b < a < c < d
    rows = make_trajectory("aa", 2, minutes=1, policy_version="v0")  # same time as "a": tie -> id order
    store.write_calls(rows)
    store.write_rewards([make_reward("aa")])
    res = select_round_dataset(store, "r1", "v0", ORDER, 0, 3, VOCAB)
    assert res.trajectory_ids == ["b", "a", "aa"]
    assert res.n_eligible == 5
    ds = res.dataset
    assert ds.schema == VALID_SCHEMA
    assert list(zip(ds.column("trajectory_id").to_pylist(), ds.column("call_index").to_pylist())) == [
        ("b", 0), ("b", 1), ("a", 0), ("a", 1), ("aa", 0), ("aa", 1)
    ]


def test_ledger_makes_next_round_skip_used_and_rematerialisation_is_idempotent(store):
    _fill(store, "v0", [f"t{i}" for i in range(6)])
    r1 = select_round_dataset(store, "round-000001", "v0", ORDER, 0, 3, VOCAB)
    assert r1.trajectory_ids == ["t0", "t1", "t2"]
    r1_again = select_round_dataset(store, "round-000001", "v0", ORDER, 0, 3, VOCAB)
    assert r1_again.trajectory_ids == r1.trajectory_ids
    r2 = select_round_dataset(store, "round-000002", "v0", ORDER, 0, 3, VOCAB)
    assert r2.trajectory_ids == ["t3", "t4", "t5"]
    assert r2.n_used_elsewhere == 3
    with pytest.raises(InsufficientDataError):
        select_round_dataset(store, "round-000003", "v0", ORDER, 0, 1, VOCAB)


def test_selection_quarantine_written_once_and_pending_not_quarantined(store):
    _fill(store, "v0", ["g0", "g1", "g2"])
    bad = make_trajectory("bad", 2, policy_version="v0")
    _set(bad[0], "output_logprobs", 1, math.nan)
    store.write_calls(bad)
    store.write_rewards([make_reward("bad")])
    _fill(store, "v0", ["pending"], reward=False)
    res = select_round_dataset(store, "r1", "v0", ORDER, 0, 2, VOCAB)
    assert res.n_eligible == 3 and res.n_quarantined == 1 and res.n_pending == 1
    assert res.quarantine_counts["non_finite_logprob"] == 1 and res.quarantined == res.quarantine_counts
    q = store.read_quarantine("r1")
    assert set(q.column("trajectory_id").to_pylist()) == {"bad"}
    assert q.column("quarantine_reason")[0].as_py() == "non_finite_logprob: call 0 output_logprobs[1]=nan"
    assert store.read_ledger("r1").to_pylist() == [
        {"trajectory_id": "g0", "status": "trained"},
        {"trajectory_id": "g1", "status": "trained"},
        {"trajectory_id": "bad", "status": "quarantined"},
    ]
    res2 = select_round_dataset(store, "r2", "v0", ORDER, 0, 1, VOCAB)
    assert res2.trajectory_ids == ["g2"] and res2.n_quarantined == 0  # "bad" not re-quarantined
    assert store.read_quarantine("r2").num_rows == 0
    store.write_rewards([make_reward("pending")])
    assert select_round_dataset(store, "r3", "v0", ORDER, 0, 1, VOCAB).trajectory_ids == ["pending"]


def test_insufficient_data_error_message_and_nothing_written(store, tmp_path):
    _fill(store, "v1", [f"t{i}" for i in range(40)])
    _fill(store, "v0", ["stale"])
    with pytest.raises(InsufficientDataError) as ei:
        select_round_dataset(store, "round-000009", "v1", ORDER, 0, 64, VOCAB,
                             requirement="S*B = steps_per_round=8 x batch_size=8")
    msg = str(ei.value)
    assert "needs 64 trajectories (S*B = steps_per_round=8 x batch_size=8) but only 40 eligible" in msg
    assert "max_policy_lag=0" in msg and "['v1']" in msg
    assert ei.value.n_required == 64 and ei.value.n_eligible == 40
    assert store.used_trajectory_ids() == set()
    assert store.read_quarantine("round-000009").num_rows == 0


def test_count_eligible_cheap_rules(store):
    _fill(store, "v1", ["a", "b", "c"])
    _fill(store, "v1", ["unrewarded"], reward=False)
    _fill(store, "v0", ["stale"])
    bad = make_trajectory("bad", 2, policy_version="v1")
    bad[1]["output_logprobs"] = bad[1]["output_logprobs"][:2]
    topbad = make_trajectory("topbad", 1, policy_version="v1")
    topbad[0]["top_logprobs"] = None  # only full validation sees this
    store.write_calls(bad + topbad)
    store.write_rewards([make_reward("bad"), make_reward("topbad"), make_reward("unrewarded", math.nan)])
    assert count_eligible(store, "v1", ORDER, 0, VOCAB) == 4  # a, b, c, topbad
    assert count_eligible(store, "v1", ORDER, 1, VOCAB) == 5  # + stale
    # the report says where the others stop: recorded in the window (a, b, c, unrewarded, bad, topbad),
    # rewarded (the NaN reward is none)
    rep = count_eligible(store, "v1", ORDER, 0, VOCAB, report=True)
    assert (rep.eligible, rep.recorded, rep.rewarded) == (4, 6, 5), rep
    res = select_round_dataset(store, "r1", "v1", ORDER, 0, 1, VOCAB)
    assert res.n_eligible == 3
    assert count_eligible(store, "v1", ORDER, 0, VOCAB) == 2  # ledger: a, bad, topbad, unrewarded consumed


def test_selection_of_seeded_random_traffic_is_deterministic(store):
    rng = np.random.default_rng(7)
    names = [f"r{i:02d}" for i in rng.permutation(20)]
    _fill(store, "v2", names)
    a = select_round_dataset(store, "x", "v2", ORDER, 0, 7, VOCAB, seed=1)
    b = select_round_dataset(store, "x", "v2", ORDER, 0, 7, VOCAB, seed=2)
    assert a.trajectory_ids == b.trajectory_ids == names[:7]
    assert a.dataset.equals(b.dataset)
