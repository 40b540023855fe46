"""The laboratory base: tokenizer, tiny model, arithmetic task, episodes, warm start (fast, seeded)."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from prodrl_pipelines.engines.types import CallRecord, SamplingParams
from prodrl_pipelines.lab import arithmetic
from prodrl_pipelines.lab.arithmetic import ArithmeticTask
from prodrl_pipelines.lab.episodes import assistant_content, render_prompt, run_episodes
from prodrl_pipelines.lab.model import build_model, lab_model_config
from prodrl_pipelines.lab.tokenizer import IM_END, IM_START, PAD_TOKEN, build_tokenizer
from prodrl_pipelines.lab.warmstart import IGNORE_INDEX, build_base_policy, sft_example
from prodrl_pipelines.trajectories.schema import CALL_FIELDS, CALL_SCHEMA


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _task(numbers, ops) -> ArithmeticTask:
    return ArithmeticTask(task_id="t", numbers=tuple(numbers), ops=tuple(ops))


# ------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_specials_and_size(tok):
    assert tok.pad_token == PAD_TOKEN and tok.eos_token == IM_END
    assert IM_START in tok.get_vocab()
    assert 100 <= len(tok) <= 300
    # digits are single tokens
    ids = tok.encode("12345", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == list("12345")


def test_tokenizer_roundtrips_task_text(tok):
    for t in arithmetic.generate_tasks(50, seed=3) + arithmetic.heldout_tasks(20):
        for m in arithmetic.reference_messages(t):
            ids = tok.encode(m["content"], add_special_tokens=False)
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == m["content"]
    text = "Hello  world\n\tthen -3 * (x+1)?"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tokenizer_deterministic():
    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert a.encode("then -3 assistant") == b.encode("then -3 assistant")


def test_chat_template_renders_qwen_style(tok):
    msgs = [
        {"role": "user", "content": "12+7"},
        {"role": "assistant", "content": "19"},
        {"role": "user", "content": "then -3"},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n"
        "<|im_start|>user\nthen -3<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert no_gen == text[: -len("<|im_start|>assistant\n")]
    ptext, ids = render_prompt(tok, msgs)
    assert ptext == text
    assert tok.decode(ids) == text
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[:3] == [IM_START, "user", "\n"] and toks[-3:] == [IM_START, "assistant", "\n"]
    assert toks.count(IM_END) == 3


# ------------------------------------------------------------------------------------ task


def test_task_generation_deterministic_and_heldout_disjoint():
    a = arithmetic.generate_tasks(300, seed=1)
    assert a == arithmetic.generate_tasks(300, seed=1)
    assert a != arithmetic.generate_tasks(300, seed=2)
    ho = arithmetic.heldout_tasks(200)
    assert ho == arithmetic.heldout_tasks(200)
    assert len({t.task_id for t in ho}) > 150
    train_ids = {t.task_id for s in range(5) for t in arithmetic.generate_tasks(500, seed=s)}
    assert not train_ids & {t.task_id for t in ho}
    assert all(arithmetic.is_heldout(t) for t in ho)
    for t in a:
        assert 2 <= t.n_turns <= 3 and len(t.numbers) == t.n_turns + 1


def test_episode_env_api():
    t = _task([12, 7, 3], ["+", "-"])
    assert arithmetic.initial_messages(t) == [{"role": "user", "content": "12+7"}]
    assert arithmetic.env_reply(t, 0, "19") == {"role": "user", "content": "then -3"}
    assert arithmetic.env_reply(t, 1, "16") is None
    assert t.true_values() == [19, 16]


def test_reward_hand_checked():
    t = _task([12, 7, 3, 5], ["+", "-", "+"])  # 19, 16, 21
    assert arithmetic.reward(t, ["19", "16", "21"]) == 1.0
    assert arithmetic.reward(t, [" 19 ", "16\n", "21"]) == 1.0  # surrounding whitespace is fine
    assert arithmetic.reward(t, ["18", "15", "20"]) == pytest.approx(2 / 3)  # later turns follow the model's own answer
    assert arithmetic.reward(t, ["18", "16", "21"]) == pytest.approx(1 / 3)
    assert arithmetic.reward(t, ["19", "sixteen", "21"]) == pytest.approx(2 / 3)  # malformed: judged vs truth after
    assert arithmetic.reward(t, ["19", "16 apples", "x"]) == pytest.approx(1 / 3)
    assert arithmetic.reward(t, ["", "", ""]) == 0.0
    assert arithmetic.reward(t, []) == 0.0
    assert arithmetic.reward(t, ["19"]) == pytest.approx(1 / 3)  # missing turns count as wrong
    neg = _task([3, 9, 4], ["-", "-"])
    assert arithmetic.reward(neg, ["-6", "-10"]) == 1.0
    assert arithmetic.reward(neg, ["6", "2"]) == 0.5
    assert arithmetic.parse_answer("--3") is None and arithmetic.parse_answer("1.5") is None


def test_noisy_demonstrations():
    import random

    t = _task([12, 7, 3, 5], ["+", "-", "+"])
    assert arithmetic.noisy_messages(t, random.Random(0)) == arithmetic.reference_messages(t)
    msgs = arithmetic.noisy_messages(t, random.Random(0), format_noise=1.0)
    assert [m["content"] for m in msgs[1::2]] == ["=19", "=16", "=21"]
    assert arithmetic.reward(t, [m["content"] for m in msgs[1::2]]) == 0.0
    a = arithmetic.noisy_messages(t, random.Random(3), answer_noise=1.0)
    answers = [int(m["content"]) for m in a[1::2]]
    assert answers[0] in (17, 18, 20, 21)
    # later turns apply their op to the value shown, so only the slips are wrong
    assert arithmetic.reward(t, [str(v) for v in answers]) == 0.0
    assert answers[1] - answers[0] in (-5, -4, -2, -1) and answers[2] - answers[1] in (3, 4, 6, 7)


# ------------------------------------------------------------------------------------ model


def test_model_builds_deterministic(tok):
    cfg = lab_model_config("tiny", vocab_size=len(tok))
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts_per_tok == 2
    a, b = build_model(cfg, seed=0), build_model(cfg, seed=0)
    c = build_model(cfg, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    dense = lab_model_config("tiny", vocab_size=len(tok), arch="dense")
    assert dense.model_type == "qwen3"
    with pytest.raises(ValueError):
        lab_model_config("huge", vocab_size=10)


def test_sft_labels_cover_assistant_tokens_only(tok):
    t = _task([12, 7, 3], ["+", "-"])
    ids, labels = sft_example(tok, t)
    full = tok.apply_chat_template(arithmetic.reference_messages(t), tokenize=False)
    assert ids == tok.encode(full, add_special_tokens=False)
    trained = [i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert tok.decode(trained) == "19<|im_end|>16<|im_end|>"


# ------------------------------------------------------------------------------------ episodes


class _ScriptedEngine:
    """Answers each prompt with a fixed text (+ stop token) and records what it was asked."""

    def __init__(self, tokenizer, answers):
        self.tok, self.answers, self.calls = tokenizer, answers, []

    def generate(self, prompts, params, seed=None):
        self.calls.append((prompts, params, seed))
        stop = params.stop_token_ids[0]
        turn = len(self.calls) - 1
        out = []
        for _ in prompts:
            ids = self.tok.encode(self.answers[turn], add_special_tokens=False) + [stop]
            out.append(
                CallRecord(
                    prompt_token_ids=[], output_token_ids=ids, output_logprobs=[-0.5] * len(ids),
                    top_token_ids=[[i] for i in ids], top_logprobs=[[-0.5] for _ in ids],
                    support_complete=False, finish_reason="stop",
                )
            )
        return out


def test_run_episodes_with_scripted_engine(tok):
    tasks = [_task([12, 7, 3], ["+", "-"]), _task([1, 1, 1, 1], ["+", "+", "+"])]
    eng = _ScriptedEngine(tok, ["19", "16", "3"])
    batch = run_episodes(eng, tok, tasks, SamplingParams(max_tokens=4), "v0", seed=5)
    assert [len(prompts) for prompts, _, _ in eng.calls] == [2, 2, 1]
    assert tok.convert_tokens_to_ids(IM_END) in eng.calls[0][1].stop_token_ids
    e0, e1 = batch.episodes
    assert e0.reward == 1.0 and e0.assistant_texts == ["19", "16"]
    assert e1.reward == pytest.approx(0.0)  # 19 != 2, 16 != 19+1... judged vs own previous answers
    assert [c["call_index"] for c in e1.calls] == [0, 1, 2]
    assert e0.calls[1]["prompt_text"].endswith("<|im_start|>user\nthen -3<|im_end|>\n<|im_start|>assistant\n")
    again = run_episodes(_ScriptedEngine(tok, ["19", "16", "3"]), tok, tasks, SamplingParams(max_tokens=4), "v0", 5)
    assert [e.trajectory_id for e in again.episodes] == [e0.trajectory_id, e1.trajectory_id]
    assert len(e0.trajectory_id) == 32 and e0.trajectory_id != e1.trajectory_id


def test_run_episodes_with_tiny_model(tok):
    from prodrl_pipelines.engines.local import LocalEngine

    cfg = lab_model_config("tiny", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    engine = LocalEngine(build_model(cfg, seed=0), tok)
    tasks = arithmetic.generate_tasks(6, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=5, num_top_logprobs=4)
    batch = run_episodes(engine, tok, tasks, params, policy_version="round-000000", seed=1)
    assert len(batch) == len(tasks)
    for ep, task in zip(batch.episodes, tasks):
        assert ep.task_id == task.task_id and 0.0 <= ep.reward <= 1.0
        assert len(ep.calls) == task.n_turns >= 2
        for i, row in enumerate(ep.calls):
            assert set(row) == set(CALL_FIELDS)
            assert row["call_index"] == i and row["trajectory_id"] == ep.trajectory_id
            assert row["policy_version"] == "round-000000"
            assert len(row["output_token_ids"]) == len(row["output_logprobs"]) == len(row["top_token_ids"]) >= 1
            assert all(len(r) == 4 for r in row["top_token_ids"])
            assert row.get("extra_token_ids") is None  # not requested
            assert row["prompt_text"] == tok.decode(row["prompt_token_ids"])
            assert row["output_text"] == assistant_content(tok, row["output_token_ids"])
            assert row["created_at"].tzinfo is not None
        # turn 2's prompt is the conversation so far: it contains turn 1's prompt and output
        first, second = ep.calls[0], ep.calls[1]
        out1 = first["output_token_ids"]
        if out1[-1] == tok.convert_tokens_to_ids(IM_END):
            expected_prefix = first["prompt_token_ids"] + out1
            assert second["prompt_token_ids"][: len(expected_prefix)] == expected_prefix
        assert first["output_text"] in second["prompt_text"]
        assert second["prompt_text"].startswith(first["prompt_text"])
    table = batch.calls_table()
    assert table.schema.equals(CALL_SCHEMA) and table.num_rows == sum(t.n_turns for t in tasks)
    assert batch.rewards_table().num_rows == len(tasks)
    assert isinstance(table, pa.Table)
    if "extra_token_ids" in CALL_FIELDS and "record_extra_draw" in SamplingParams.__dataclass_fields__:
        extra = run_episodes(engine, tok, tasks[:2], SamplingParams(max_tokens=5, record_extra_draw=True), "v", 1)
        for row in extra.call_rows():
            assert len(row["extra_token_ids"]) == len(row["output_token_ids"])


# ------------------------------------------------------------------------------------ base policy


def test_build_base_policy_tiny_loadable_and_deterministic(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_base_policy(tmp_path / "a", size="tiny", seed=0, sft_steps=5, progress=False)
    b = build_base_policy(tmp_path / "b", size="tiny", seed=0, sft_steps=5, progress=False)
    assert (a / "model.safetensors").exists() and (a / "config.json").exists()
    ma = AutoModelForCausalLM.from_pretrained(a)
    mb = AutoModelForCausalLM.from_pretrained(b)
    assert type(ma).__name__ == "Qwen3MoeForCausalLM"
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    tk = AutoTokenizer.from_pretrained(a)
    msgs = [{"role": "user", "content": "1+2"}]
    assert tk.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tk.eos_token == IM_END and tk.pad_token == PAD_TOKEN
    ids = tk.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    out = ma.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] >= len(ids) + 1


# ------------------------------------------------------------------------------------ the demo's process


def test_the_demo_still_stops_on_sigterm_after_running_dagster_where_sigint_is_ignored():
    """A shell's background job ignores SIGINT. Dagster's in-process execution ends by giving SIGTERM
    SIGINT's disposition, so there ``kill`` would no longer stop the demo and every server it started
    afterwards would ignore SIGTERM too; the demo runs its jobs under ``keeping_sigterm``."""
    import signal
    import subprocess

    from dagster import job, op

    from prodrl_pipelines.lab.demo import keeping_sigterm

    @op
    def one():
        return 1

    @job
    def tiny():
        one()

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert tiny.execute_in_process().success
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # what Dagster leaves without it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with keeping_sigterm():
            assert tiny.execute_in_process().success
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        child = subprocess.Popen(["sleep", "600"])  # a process started afterwards dies of SIGTERM
        child.terminate()
        assert child.wait(60) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])
