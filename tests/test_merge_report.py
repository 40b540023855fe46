"""``prodrl data merges`` (rl/merge_report.py): random multi-call episodes, each step joined to the one
before by a chosen rule (the prompt extends the previous prompt + output, re-renders the output, or
edits the history), stored shuffled across policy versions, with gaps, crossed versions and duplicated
rows; the report's counts are what the chosen joins say, computed here without the layout code."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from helpers import make_call

from prodrl_pipelines.rl.merge_report import merge_report, merge_rows
from prodrl_pipelines.rl.sequences import SPLIT_REASONS
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore

JOINS = ("merged", "merged_no_context", "output_rewritten", "history_edited")
VERSIONS = ("v1", "v2", "v3")
OTHER = 900  # token ids no generator draws: a rewritten output or an edited history differs for certain


def _ids(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(3, 400) for _ in range(rng.randint(lo, hi))]


def _episode(rng: random.Random, joins: list[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of each call; call j+1 is joined to call j by ``joins[j]``."""
    calls = [(_ids(rng, 2, 8), _ids(rng, 1, 6))]
    for join in joins:
        prompt, out = calls[-1]
        context = [] if join == "merged_no_context" else _ids(rng, 1, 5)  # a tool result, the next user turn
        if join == "output_rewritten":  # the template re-rendered the model's output (dropped reasoning, ...)
            out = [OTHER] + out[1:]
        elif join == "history_edited":  # the harness truncated or summarised the history
            prompt = [prompt[0] + OTHER] + prompt[1:]
        calls.append((prompt + out + context, _ids(rng, 1, 6)))
    return calls


def _expected(calls, joins) -> dict:
    """Sequences, splits and positions of one episode, from its joins alone."""
    splits = Counter(j for j in joins if j in SPLIT_REASONS)
    ends = [i for i, j in enumerate(joins) if j in SPLIT_REASONS] + [len(calls) - 1]  # each sequence's last call
    seq_tokens = sum(len(calls[i][0]) + len(calls[i][1]) - 1 for i in ends)
    per_call = sum(len(p) + len(o) - 1 for p, o in calls)
    return {"sequences": 1 + sum(splits.values()), "splits": splits, "seq_tokens": seq_tokens, "per_call": per_call}


def _row(tid: str, index: int, version: str, prompt: list[int], out: list[int]) -> dict:
    return make_call(tid, index, policy_version=version, n_tokens=len(out), prompt_token_ids=prompt,
                     output_token_ids=out)


def _world(seed: int):
    """Stored rows (shuffled) and the report they must give."""
    rng = random.Random(seed)
    rows, want = [], {}

    def tally(version: str) -> dict:
        return want.setdefault(version, {"trajectories": 0, "multi_call": 0, "merged_whole": 0, "sequences": 0,
                                         "splits": Counter(), "incomplete": 0, "crossed_versions": 0,
                                         "seq_tokens": 0, "per_call": 0})

    for t in range(rng.randint(25, 40)):
        tid, version = f"ep-{seed}-{t}", rng.choice(VERSIONS)
        kind = rng.choices(["episode", "single", "gap", "crossed"], [6, 2, 1, 1])[0]
        joins = rng.choices(JOINS, [3, 1, 1, 1], k=rng.randint(1, 6)) if kind != "single" else []
        calls = _episode(rng, joins)
        w = tally(version)
        w["trajectories"] += 1
        versions = [version] * len(calls)
        if kind == "crossed":  # a rolling wave: the later calls under the next version, laid out whole
            cut = rng.randint(1, len(calls) - 1)
            later = VERSIONS[(VERSIONS.index(version) + 1) % len(VERSIONS)]
            versions = [version] * cut + [later] * (len(calls) - cut)
            w["crossed_versions"] += 1
        indices = list(range(len(calls)))
        if kind == "gap":  # a call the recorder skipped (unrecordable): the trajectory is never laid out
            indices = [i if i < len(calls) - 1 else i + 1 for i in indices]
            w["incomplete"] += 1
        elif len(calls) >= 2:
            e = _expected(calls, joins)
            w["multi_call"] += 1
            w["merged_whole"] += e["sequences"] == 1
            w["sequences"] += e["sequences"]
            w["splits"] += e["splits"]
            w["seq_tokens"] += e["seq_tokens"]
            w["per_call"] += e["per_call"]
        rows += [_row(tid, i, v, p, o) for i, v, (p, o) in zip(indices, versions, calls)]
    dupes = [dict(r) for r in rng.sample(rows, 5)]  # a client's retry stored twice: read once
    rng.shuffle(rows)
    return rows, dupes, {v: w for v, w in want.items()}


def _store(tmp_path, rows, dupes) -> TrajectoryStore:
    store = TrajectoryStore(LocalBlobStore(tmp_path / "home" / "store"))
    third = len(rows) // 3
    for part in (rows[:third], rows[third:2 * third], rows[2 * third:], dupes):  # several commits, shuffled
        store.write_calls(part)
    return store


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_counts_are_what_the_chosen_joins_say(tmp_path, seed):
    rows, dupes, want = _world(seed)
    report = merge_rows(_store(tmp_path, rows, dupes))
    assert [r["policy_version"] for r in report] == sorted(want)
    for r in report:
        w = want[r["policy_version"]]
        assert r == {
            "policy_version": r["policy_version"], "trajectories": w["trajectories"], "multi_call": w["multi_call"],
            "merged_whole": w["merged_whole"],
            "merged_frac": round(w["merged_whole"] / w["multi_call"], 4) if w["multi_call"] else None,
            "sequences": w["sequences"], "split_output_rewritten": w["splits"]["output_rewritten"],
            "split_history_edited": w["splits"]["history_edited"], "incomplete": w["incomplete"],
            "crossed_versions": w["crossed_versions"],
            "tokens_saved_frac": round(1 - w["seq_tokens"] / w["per_call"], 4) if w["per_call"] else None,
        }, r["policy_version"]
    assert sum(r["multi_call"] for r in report) > 10 and sum(r["split_output_rewritten"] for r in report) > 0
    assert sum(r["merged_whole"] for r in report) > 0 and sum(r["split_history_edited"] for r in report) > 0


def test_chunks_and_a_version_filter_change_nothing(tmp_path):
    rows, dupes, want = _world(7)
    store = _store(tmp_path, rows, dupes)
    whole = {c.policy_version: c.as_row() for c in merge_report(store)}
    assert {c.policy_version: c.as_row() for c in merge_report(store, chunk=3)} == whole
    assert [c.as_row() for c in merge_report(store, ["v2"])] == [whole["v2"]]
    assert merge_report(TrajectoryStore(LocalBlobStore(tmp_path / "empty"))) == []


def test_prodrl_data_merges(tmp_path, capsys):
    from prodrl_pipelines.cli.main import main

    rows, dupes, _ = _world(3)
    store = _store(tmp_path, rows, dupes)
    settings = tmp_path / "s.json"
    settings.write_text(json.dumps({"home": str(tmp_path / "home")}))
    assert main(["data", "merges", "--settings", str(settings), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == merge_rows(store)
    assert main(["data", "merges", "--settings", str(settings), "--policy-version", "v1", "--policy-version", "v3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == list(merge_rows(store)[0])
    assert [ln.split()[0] for ln in lines[1:]] == ["v1", "v3"]
