"""Multi-turn replay: training uses the recorded ids of every call; the retokenized baseline does not.

A conversation re-rendered from its texts differs from what the engine consumed and sampled when the
chat template rewrites history (here: it trims assistant content), when the server feeds the sampled
ids back (token-in/token-out) instead of re-rendered text, when the model sampled a non-canonical
tokenization ("t" "h" "e" "n" instead of "then"), or when it stopped on a token other than eos.
"""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from prodrl_pipelines.lab.tokenizer import CHAT_TEMPLATE, build_tokenizer
from prodrl_pipelines.rl.batch import pack_minibatch
from prodrl_pipelines.rl.trajectory import trajectories_from_table
from prodrl_pipelines.trajectories.retokenize import FILLED_COLUMN, differing_tokens, parse_chatml, retokenize_calls
from prodrl_pipelines.trajectories.schema import CALL_SCHEMA, UNTRAINED_COLUMN

# Like the lab template, but assistant content is trimmed when (re-)rendered (Qwen3's template
# similarly rewrites earlier assistant turns).
TRIM_TEMPLATE = CHAT_TEMPLATE.replace(
    "message['content'] + '<|im_end|>'",
    "(message['content'] | trim if message['role'] == 'assistant' else message['content']) + '<|im_end|>'",
)
assert TRIM_TEMPLATE != CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def trim_tok():
    t = build_tokenizer()
    t.chat_template = TRIM_TEMPLATE
    return t


def ids_of(tok, *tokens: str) -> list[int]:
    """Ids of the given vocabulary entries, one per entry (a possibly non-canonical tokenization)."""
    out = tok.convert_tokens_to_ids(list(tokens))
    assert tok.unk_token_id not in out, tokens
    return out


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def render(tok, messages, gen=True) -> tuple[str, list[int]]:
    text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    return text, enc(tok, text)


def call_row(tid: str, k: int, prompt_text: str, prompt_ids: list[int], out_ids: list[int], output_text: str,
             *, reward: float = 1.0, seed: int = 0) -> dict:
    rng = np.random.default_rng([seed, k, len(tid)])
    n = len(out_ids)
    lps = (-rng.random(n) * 2).round(3).tolist()
    return {
        "trajectory_id": tid, "call_index": k, "task_id": f"task-{tid}", "policy_version": "v0",
        "prompt_token_ids": list(prompt_ids), "output_token_ids": list(out_ids), "output_logprobs": lps,
        "top_token_ids": [[t, (t + 1) % 100] for t in out_ids], "top_logprobs": [[lp, lp - 1.0] for lp in lps],
        "support_complete": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "extra_token_ids": list(out_ids), "prompt_text": prompt_text, "output_text": output_text,
        "reward": reward,
    }


def to_table(rows: list[dict]) -> pa.Table:
    schema = pa.schema([f for f in CALL_SCHEMA if f.name != "created_at"]).append(pa.field("reward", pa.float64()))
    return pa.Table.from_pylist(rows, schema=schema)


# ----------------------------------------------------------------------------- recorded replay


def tito_conversation(tok) -> tuple[pa.Table, list[dict]]:
    """Two calls served token-in/token-out: call 1's prompt is call 0's prompt + sampled ids + the new turn."""
    eos = tok.eos_token_id
    user0 = {"role": "user", "content": "12+7"}
    p0_text, p0 = render(tok, [user0])
    o0 = ids_of(tok, " ", "1", "9", " ") + [eos]  # " 19 ": whitespace the trimming template drops
    a0 = " 19 "
    turn = "\n<|im_start|>user\nthen -3<|im_end|>\n<|im_start|>assistant\n"
    p1 = p0 + o0 + enc(tok, turn)
    p1_text = tok.decode(p1)
    o1 = ids_of(tok, "t", "hen", " ", "1", "6") + [eos]  # non-canonical: "then" is one token
    a1 = "then 16"
    rows = [call_row("traj", 0, p0_text, p0, o0, a0), call_row("traj", 1, p1_text, p1, o1, a1)]
    messages = [user0, {"role": "assistant", "content": a0}, {"role": "user", "content": "then -3"},
                {"role": "assistant", "content": a1}]
    return to_table(rows), messages


def test_training_uses_recorded_ids_per_call(trim_tok):
    tok = trim_tok
    table, messages = tito_conversation(tok)
    rec = table.to_pylist()

    # training examples: the recorded ids of each call, exactly
    (traj,) = trajectories_from_table(table)
    for c, r in zip(traj.calls, rec):
        assert c.prompt_ids == r["prompt_token_ids"] and c.output_ids == r["output_token_ids"]
    batch = pack_minibatch([traj], np.array([1.0]), pad_id=tok.pad_token_id)
    assert batch.targets.tolist() == rec[0]["output_token_ids"] + rec[1]["output_token_ids"]
    assert np.allclose(batch.logp_mu.numpy(), rec[0]["output_logprobs"] + rec[1]["output_logprobs"])
    for g in range(batch.num_tokens):  # each target is predicted from exactly the recorded context
        row, pos = int(batch.gen_row[g]), int(batch.gen_pos[g])
        seq = rec[row]["prompt_token_ids"] + rec[row]["output_token_ids"]
        assert batch.input_ids[row, : pos + 1].tolist() == seq[: pos + 1]
        assert int(batch.targets[g]) == seq[pos + 1]
    for row, r in enumerate(rec):
        n = len(r["prompt_token_ids"]) + len(r["output_token_ids"]) - 1
        assert batch.input_ids[row, :n].tolist() == (r["prompt_token_ids"] + r["output_token_ids"])[:-1]
        assert int(batch.attention_mask[row].sum()) == n

    # a conversation re-rendered from its texts gives other ids
    _, p1_rerendered = render(tok, messages[:3])
    assert p1_rerendered != rec[1]["prompt_token_ids"]  # the template trimmed " 19 " to "19"
    full_text, full = render(tok, messages, gen=False)
    assert "\n19<|im_end|>" in full_text and " 19 " not in full_text
    assert rec[0]["prompt_token_ids"] + rec[0]["output_token_ids"] != full[: len(rec[0]["prompt_token_ids"]) + 5]
    assert enc(tok, messages[3]["content"]) != rec[1]["output_token_ids"][:-1]  # the tokenizer merges "t"+"hen"

    # ... and so does the retokenized baseline, which counts the calls
    retok, stats = retokenize_calls(table, tok)
    new = retok.to_pylist()
    assert new[0]["prompt_token_ids"] == rec[0]["prompt_token_ids"]
    assert new[1]["prompt_token_ids"] == p1_rerendered
    assert new[0]["output_token_ids"] == rec[0]["output_token_ids"]  # " 19 " + eos is canonical
    assert new[1]["output_token_ids"] == enc(tok, "then 16") + [tok.eos_token_id]
    assert (stats.prompt_ids_differ, stats.output_ids_differ, stats.calls_differ, stats.trajectories_differ) == (1, 1, 1, 1)
    (rtraj,) = trajectories_from_table(retok)
    rbatch = pack_minibatch([rtraj], np.array([1.0]), pad_id=tok.pad_token_id)
    assert rbatch.targets.tolist() != batch.targets.tolist()


def test_lab_template_re_renders_tito_history_differently(tok):
    """Even with the lab's own template, a token-in/token-out history is not what re-rendering gives."""
    table, messages = tito_conversation(tok)
    rec = table.to_pylist()
    _, p1_rerendered = render(tok, messages[:3])
    assert p1_rerendered == rec[1]["prompt_token_ids"]  # canonical " 19 ": the same ids here
    _, stats = retokenize_calls(table, tok)
    assert (stats.prompt_ids_differ, stats.output_ids_differ) == (0, 1)


# ----------------------------------------------------------------------------- retokenized baseline


def handmade_table(tok) -> tuple[pa.Table, dict]:
    eos, pad = tok.eos_token_id, tok.pad_token_id
    rows = []
    # T1: served like the lab (re-rendered text, canonical outputs): nothing differs
    u = {"role": "user", "content": "12+7"}
    t, p = render(tok, [u])
    rows.append(call_row("t1", 0, t, p, enc(tok, "19") + [eos], "19", seed=1))
    t, p = render(tok, [u, {"role": "assistant", "content": "19"}, {"role": "user", "content": "then -3"}])
    rows.append(call_row("t1", 1, t, p, enc(tok, "16") + [eos], "16", seed=1))
    # T2: token-in/token-out with a non-canonical output: call 0's output and call 1's prompt differ
    t0, p0 = render(tok, [{"role": "user", "content": "4*2"}])
    o0 = ids_of(tok, "t", "h", "e", "n") + [eos]
    p1 = p0 + o0 + enc(tok, "\n<|im_start|>user\n5<|im_end|>\n<|im_start|>assistant\n")
    rows.append(call_row("t2", 0, t0, p0, o0, "then", seed=2))
    rows.append(call_row("t2", 1, tok.decode(p1), p1, enc(tok, "2") + [eos], "2", seed=2))
    # T3: cut off by max_tokens (no eos): the naive pipeline appends one
    t, p = render(tok, [{"role": "user", "content": "9-1"}])
    rows.append(call_row("t3", 0, t, p, enc(tok, "12"), "12", seed=3))
    # T4: stopped on <|endoftext|>: same length, last id differs
    t, p = render(tok, [{"role": "user", "content": "3+3"}])
    rows.append(call_row("t4", 0, t, p, enc(tok, "7") + [pad], "7", seed=4))
    # T5: a prompt that is not ChatML is tokenized as plain text (identical here)
    rows.append(call_row("t5", 0, "plain 1+1", enc(tok, "plain 1+1"), enc(tok, "2") + [eos], "2", seed=5))
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    expected = {"calls": 7, "prompt_ids_differ": 1, "output_ids_differ": 3, "calls_differ": 4,
                "trajectories_differ": 3, "logprobs_filled": 2, "prompt_unparsed": 1,
                "multi_turn_calls": 2, "multi_turn_calls_differ": 1}
    return to_table(shuffled), expected


def test_retokenize_counts_on_handmade_calls(tok):
    table, expected = handmade_table(tok)
    retok, stats = retokenize_calls(table, tok)
    for k, v in expected.items():
        assert getattr(stats, k) == v, k
    d = stats.as_dict()
    assert d["retokenized_prompt_ids_differ"] == 1 and d["retokenized_output_ids_differ"] == 3
    assert retok.num_rows == table.num_rows and retok.column_names == table.column_names + [FILLED_COLUMN, UNTRAINED_COLUMN]
    assert retok.schema.remove(retok.num_columns - 1).remove(retok.num_columns - 2).equals(table.schema)
    assert stats.untrained == 0 and not any(retok.column(UNTRAINED_COLUMN).to_pylist())  # sampled unrestricted
    want_tokens = sum(differing_tokens(after[c], before[c]) for before, after in zip(table.to_pylist(), retok.to_pylist())
                      for c in ("prompt_token_ids", "output_token_ids"))  # row order is kept
    assert stats.tokens_differ == want_tokens > 0
    assert stats.tokens_per_differing_call == pytest.approx(want_tokens / 4)
    old = {(r["trajectory_id"], r["call_index"]): r for r in table.to_pylist()}
    new = {(r["trajectory_id"], r["call_index"]): r for r in retok.to_pylist()}
    assert [(r["trajectory_id"], r["call_index"]) for r in retok.to_pylist()] == list(old)  # row order kept
    eos = tok.eos_token_id
    filled = {k for k, r in new.items() if r[FILLED_COLUMN]}
    assert filled == {("t2", 0), ("t3", 0)}
    for k in filled:  # no valid mu: the call's mean recorded logprob, the token itself as head
        r, o = new[k], old[k]
        mean = float(np.mean(np.float32(o["output_logprobs"])))
        assert r["output_logprobs"] == pytest.approx([mean] * len(r["output_token_ids"]), abs=1e-6)
        assert r["top_token_ids"] == [[t] for t in r["output_token_ids"]]
        assert r["extra_token_ids"] is None and r["support_complete"] is False
    assert new[("t2", 0)]["output_token_ids"] == enc(tok, "then") + [eos]
    assert new[("t3", 0)]["output_token_ids"] == enc(tok, "12") + [eos]
    # same length: the recorded logprobs and head at the same positions
    r, o = new[("t4", 0)], old[("t4", 0)]
    assert r["output_token_ids"] == enc(tok, "7") + [eos] != o["output_token_ids"]
    for col in ("output_logprobs", "top_token_ids", "top_logprobs", "extra_token_ids"):
        assert r[col] == o[col], col
    # the rebuilt prompt of T2's second call is the re-rendered conversation
    t, p = render(tok, [{"role": "user", "content": "4*2"}, {"role": "assistant", "content": "then"},
                        {"role": "user", "content": "5"}])
    assert new[("t2", 1)]["prompt_token_ids"] == p != old[("t2", 1)]["prompt_token_ids"]
    for k in old:
        if k not in {("t2", 0), ("t2", 1), ("t3", 0), ("t4", 0)}:
            assert new[k]["prompt_token_ids"] == old[k]["prompt_token_ids"]
            assert new[k]["output_token_ids"] == old[k]["output_token_ids"]
    # the retokenized table trains like any other
    trajs = trajectories_from_table(retok)
    b = pack_minibatch(trajs, np.ones(len(trajs)), pad_id=tok.pad_token_id)
    assert b.num_tokens == stats.generated_tokens_retokenized == sum(len(r["output_token_ids"]) for r in new.values())
    assert np.isfinite(b.logp_mu.numpy()).all()


def test_retokenize_errors(tok):
    table, _ = handmade_table(tok)
    with pytest.raises(ValueError, match="output_text"):
        retokenize_calls(table.drop_columns(["output_text"]), tok)
    rows = table.to_pylist()
    rows[2]["prompt_text"] = None
    with pytest.raises(ValueError, match=f"{rows[2]['trajectory_id']}#{rows[2]['call_index']}"):
        retokenize_calls(to_table(rows), tok)


def test_parse_chatml():
    text = "<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\na<|im_end|>b<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
    # the stored reply contains a marker: found by its known text
    msgs, gen = parse_chatml(text + "<|im_start|>assistant\n", ["a<|im_end|>b"])
    assert gen and msgs == [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "a<|im_end|>b"},
                            {"role": "user", "content": "x"}]
    msgs, gen = parse_chatml("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n")
    assert not gen and [m["role"] for m in msgs] == ["system", "user"]
    assert parse_chatml("plain text") is None
    assert parse_chatml("<|im_start|>user\nunterminated") is None
    assert parse_chatml("") == ([], False)


# ----------------------------------------------------------------------------- lab data


@pytest.fixture(scope="module")
def lab_base(tmp_path_factory):
    """The lab base policy, tiny and briefly warm-started (so some replies stop, some are cut off)."""
    from prodrl_pipelines.lab.warmstart import build_base_policy

    return build_base_policy(tmp_path_factory.mktemp("base"), size="tiny", seed=0, sft_steps=40, progress=False)


@pytest.fixture(scope="module")
def lab_batch(tok, lab_base):
    from prodrl_pipelines.loop.round_state import BASE_VERSION
    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.engines.types import SamplingParams
    from prodrl_pipelines.lab import arithmetic
    from prodrl_pipelines.lab.episodes import run_episodes

    engine = LocalEngine.from_pretrained(lab_base)
    assert engine.tokenizer.get_vocab() == tok.get_vocab()
    tasks = arithmetic.generate_tasks(8, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=8, num_top_logprobs=4)
    return run_episodes(engine, engine.tokenizer, tasks, params, policy_version=BASE_VERSION, seed=1)


def expected_lab_counts(tok, rows: list[dict]) -> dict:
    """Counted independently of retokenize_calls, from the recorded ids alone."""
    eos = tok.eos_token_id
    out_differ = filled = 0
    for r in rows:
        ids = r["output_token_ids"]
        stopped = bool(ids) and ids[-1] == eos
        body = ids[:-1] if stopped else ids
        canonical = enc(tok, tok.decode(body)) == body
        out_differ += not (stopped and canonical)
        filled += len(enc(tok, tok.decode(body))) + 1 != len(ids)
    return {"calls": len(rows), "prompt_ids_differ": 0, "output_ids_differ": out_differ, "logprobs_filled": filled}


def test_retokenize_counts_on_lab_episodes(tok, lab_batch):
    rows = lab_batch.call_rows()
    table = lab_batch.calls_table()
    _, stats = retokenize_calls(table, tok)
    exp = expected_lab_counts(tok, rows)
    # the lab server re-renders each call's prompt through the same template from the decoded replies,
    # so the prompts come out the same; outputs differ where the model was cut off or sampled a
    # non-canonical tokenization
    for k, v in exp.items():
        assert getattr(stats, k) == v, k
    assert stats.prompt_unparsed == 0
    assert 0 < stats.output_ids_differ < stats.calls
    assert stats.trajectories_differ == len({r["trajectory_id"] for r, d in zip(rows, _differs(tok, rows)) if d})


def _differs(tok, rows):
    eos = tok.eos_token_id
    return [r["output_token_ids"] != enc(tok, r["output_text"]) + [eos] for r in rows]


def test_select_data_retokenized(tok, lab_base, lab_batch, tmp_path):
    """data.select_data with replay=retokenized writes the rebuilt dataset and reports the counts."""
    from prodrl_pipelines.loop import data
    from prodrl_pipelines.loop import services
    from prodrl_pipelines.storage import documents
    from prodrl_pipelines.loop.round_state import BASE_VERSION
    from prodrl_pipelines.loop.ledger import LiveDeployment
    from prodrl_pipelines.rl.config import Recipe
    from prodrl_pipelines.config.settings import Settings
    from prodrl_pipelines.storage.blobstore import LocalBlobStore

    ckpt = lab_base
    blobs = LocalBlobStore(tmp_path / "store")
    out = {}
    for replay in ("recorded", "retokenized"):
        settings = Settings(home=str(tmp_path / "home"), recipe=Recipe(steps_per_round=4, batch_size=2, replay=replay))
        svc = services.Services(settings=settings, blobs=blobs)
        if replay == "recorded":
            svc.ledger.deploy(LiveDeployment(BASE_VERSION, str(ckpt), str(tmp_path / "export")))
            svc.store.write_calls(lab_batch.calls_table())
            svc.store.write_rewards(lab_batch.rewards_table())
        stats = data.select_data(svc, "round-000001")  # same round twice: idempotent re-selection
        out[replay] = (stats, documents.get_table(blobs, "rounds/round-000001/dataset.parquet"))
    rec_stats, rec_ds = out["recorded"]
    ret_stats, ret_ds = out["retokenized"]
    assert rec_stats["replay"] == "recorded" and not any(k.startswith("retokenized_") for k in rec_stats)
    assert FILLED_COLUMN not in rec_ds.column_names
    _, direct = retokenize_calls(rec_ds, tok)
    assert ret_stats["replay"] == "retokenized"
    assert {k: v for k, v in ret_stats.items() if k.startswith("retokenized_")} == direct.as_dict()
    exp = expected_lab_counts(tok, rec_ds.to_pylist())
    assert ret_stats["retokenized_output_ids_differ"] == exp["output_ids_differ"] > 0
    assert ret_stats["retokenized_prompt_ids_differ"] == 0
    assert ret_stats["num_trajectories"] == rec_stats["num_trajectories"] == 8
    assert ret_stats["generated_tokens"] == direct.generated_tokens_retokenized
    assert FILLED_COLUMN in ret_ds.column_names
    assert sum(ret_ds[FILLED_COLUMN].to_pylist()) == direct.logprobs_filled
    # the recorded dataset trains on the recorded ids; the retokenized one on the rebuilt ids
    key = lambda t: (t["trajectory_id"], t["call_index"])  # noqa: E731
    rec_rows = sorted(rec_ds.to_pylist(), key=key)
    ret_rows = sorted(ret_ds.to_pylist(), key=key)
    calls = sorted(lab_batch.call_rows(), key=key)
    assert [r["output_token_ids"] for r in rec_rows] == [c["output_token_ids"] for c in calls]
    assert [r["output_token_ids"] for r in ret_rows] == [enc(tok, c["output_text"]) + [tok.eos_token_id] for c in calls]


def test_replay_setting_reaches_the_recipe():
    from prodrl_pipelines.resources.settings import ProdRLSettings

    assert ProdRLSettings().settings().recipe.replay == "recorded"
    assert ProdRLSettings(replay="retokenized").settings().recipe.replay == "retokenized"
    with pytest.raises(Exception, match="replay"):
        ProdRLSettings(replay="rerendered").settings()


@pytest.mark.parametrize("restriction", [{"top_k": 5}, {"top_p": 0.9}])
def test_a_retokenized_call_with_an_unknown_restricted_support_is_not_trained_on(tok, restriction):
    """Its length changed, so no recorded log mu or head lines up with it; sampled with top-k/top-p
    its support is unknown, and the one-token head it used to get made S = {a}: every IS correction
    then gave it an exactly zero gradient, silently. Now it is left out of the objective, counted."""
    table, _ = handmade_table(tok)
    rows = [r | restriction for r in table.to_pylist()]
    retok, stats = retokenize_calls(to_table(rows), tok)
    assert stats.logprobs_filled == 2 and stats.untrained == 2
    untrained = {(r["trajectory_id"], r["call_index"]) for r in retok.to_pylist() if r[UNTRAINED_COLUMN]}
    assert untrained == {("t2", 0), ("t3", 0)}
    trajs = {t.trajectory_id: t for t in trajectories_from_table(retok)}
    b = pack_minibatch([trajs["t2"], trajs["t3"]], np.ones(2), pad_id=tok.pad_token_id, vocab_size=len(tok))
    n0 = len(trajs["t2"].calls[0].output_ids)
    t2_tokens = n0 + len(trajs["t2"].calls[1].output_ids)
    assert b.weight[:n0].tolist() == [0.0] * n0  # t2's call 0: kept as context, not trained
    assert b.weight[n0:t2_tokens].tolist() == pytest.approx([1 / (2 * (t2_tokens - n0))] * (t2_tokens - n0))
    assert float(b.weight[t2_tokens:].sum()) == 0.0  # t3: its only call untrained
    # unrestricted sampling keeps them (the support is the vocabulary: nothing to renormalise)
    assert retokenize_calls(table, tok)[1].untrained == 0


@pytest.mark.parametrize("a, b, n", [([1, 2, 3], [1, 2, 3], 0), ([1, 2, 3], [1, 9, 3], 1), ([1, 2, 3, 4], [1, 5, 6, 7, 4], 3),
                                     ([], [1, 2], 2), ([1, 1], [1], 1), ([5, 6], [7, 8], 2)])
def test_differing_tokens(a, b, n):
    assert differing_tokens(a, b) == differing_tokens(b, a) == n
