"""The arithmetic task in production text: the server's reply parser, the task's verifier and
environment, and what recorded and retokenized replay make of its episodes."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from prodrl_pipelines.engines.local import LocalEngine
from prodrl_pipelines.engines.reply_parsers import get_reply_parser, parse_plain, parse_qwen3
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.evaluation.episodes import render_prompt
from prodrl_pipelines.lab import arithmetic_tools as at
from prodrl_pipelines.lab.arithmetic import ArithmeticTask
from prodrl_pipelines.lab.episodes import run_episodes
from prodrl_pipelines.lab.production_text import non_canonical_split
from prodrl_pipelines.lab.tasks import get_task
from prodrl_pipelines.lab.warmstart import _CallEncoder, build_base_policy
from prodrl_pipelines.rl.trajectory import trajectories_from_table
from prodrl_pipelines.trajectories.retokenize import differing_tokens, render_reply, retokenize_calls

ENV = get_task("arithmetic_tools")
TASK = ArithmeticTask(task_id="arith-x", numbers=(12, 7, 3), ops=("+", "-"))
SPACED = '<think>\n12+7\n</think>\n\n<tool_call>\n{"name": "answer", "arguments": {"value": 19}}\n</tool_call>'
COMPACT = '<think>\n19-3\n</think>\n\n<tool_call>\n{"name":"answer","arguments":{"value":16}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return ENV.build_tokenizer()


def test_the_qwen3_parser_splits_reasoning_content_and_re_serialised_calls():
    assert parse_qwen3(COMPACT) == {
        "role": "assistant", "content": None, "reasoning_content": "\n19-3\n",
        "tool_calls": [{"id": "call_0", "type": "function",
                        "function": {"name": "answer", "arguments": '{"value": 16}'}}]}
    # no </think>: the text before the call is reasoning, as vLLM's qwen3 parser has it
    no_think = parse_qwen3('so <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert no_think["content"] is None and no_think["reasoning_content"] == "so " and len(no_think["tool_calls"]) == 1
    # a broken call stays text, as vLLM's hermes parser leaves it
    broken = '<think>\nx\n</think>\n\n<tool_call>\n{"name": "answer", "arguments": {"value": 1}\n</tool_call>'
    msg = parse_qwen3(broken)
    assert "tool_calls" not in msg and msg["content"].startswith("\n\n<tool_call>") and msg["reasoning_content"] == "\nx\n"
    assert parse_plain("19") == {"role": "assistant", "content": "19"}
    with pytest.raises(ValueError, match="unknown reply parser 'hermes'.*none, qwen3"):
        get_reply_parser("hermes")


def test_the_verifier_reads_the_tool_call_and_judges_against_the_models_own_answer():
    assert at.reward(TASK, [SPACED, COMPACT]) == 1.0  # compact and spaced calls alike
    plain = "<think>\n12+7\n</think>\n\n19"
    assert at.reward(TASK, [plain, COMPACT]) == 0.5  # a plain-text answer is wrong; the next turn still counts
    wrong = SPACED.replace("19", "20")
    assert at.reward(TASK, [wrong, COMPACT.replace("16", "17")]) == 0.5  # 20-3 = 17 against its own answer
    assert at.reward(TASK, [SPACED]) == 0.5  # a missing turn is wrong
    two = SPACED + "\n" + SPACED.split("\n\n", 1)[1]
    assert at.parse_answer(two) is None  # one call per answer
    assert at.parse_answer(SPACED.replace("19", '"19"')) is None and at.parse_answer(SPACED.replace("19", "true")) is None
    assert at.parse_answer(SPACED.replace('{"value": 19}', "[19]")) is None  # a call whose arguments are no object


def test_the_environment_answers_a_call_with_its_result_and_the_next_operation():
    assert at.env_reply(TASK, 0, SPACED) == [{"role": "tool", "content": "ok"}, {"role": "user", "content": "then -3"}]
    assert at.env_reply(TASK, 0, "19") == [{"role": "user", "content": "then -3"}]
    assert at.env_reply(TASK, 1, COMPACT) is None


def test_the_harness_history_is_not_what_the_model_sampled(tok):
    """Call 1's prompt holds call 0's reply as the server parsed it and the template rendered it:
    reasoning dropped, the compact call re-serialised -- no prefix of call 0's prompt + sampled text."""
    msgs = [{"role": "user", "content": "12+7"}]
    p0_text, p0 = render_prompt(tok, msgs)
    sampled = COMPACT.replace("19-3", "12+7").replace("16", "19")
    msgs += [parse_qwen3(sampled), {"role": "tool", "content": "ok"}, {"role": "user", "content": "then -3"}]
    p1_text, p1 = render_prompt(tok, msgs)
    assert p1_text == (
        "<|im_start|>user\n12+7<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "answer", "arguments": {"value": 19}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nthen -3<|im_end|>\n<|im_start|>assistant\n")
    sampled_ids = tok.encode(sampled, add_special_tokens=False) + [tok.eos_token_id]
    assert p1[: len(p0) + len(sampled_ids)] != p0 + sampled_ids


def test_sft_examples_are_the_calls_as_served(tok):
    """The warm start trains each call on the prompt the server renders from the harness's history."""
    msgs = at.noisy_messages(TASK, random.Random(0), compact_noise=1.0)
    (ids0, lab0), (ids1, lab1) = _CallEncoder(tok, ENV).encode_calls(msgs)
    history = [msgs[0], parse_qwen3(msgs[1]["content"]), msgs[2], msgs[3]]
    _, p1 = render_prompt(tok, history, ENV.tools)
    assert ids1[: len(p1)] == p1 and all(x == -100 for x in lab1[: len(p1)])
    assert tok.decode(ids1[len(p1):]) == msgs[4]["content"] + "<|im_end|>"
    assert [x for x in lab1 if x != -100] == ids1[len(p1):]


def row(tid, k, prompt_text, prompt_ids, out_ids, output_text):
    n = len(out_ids)
    return {"trajectory_id": tid, "call_index": k, "prompt_text": prompt_text, "prompt_token_ids": prompt_ids,
            "output_token_ids": out_ids, "output_logprobs": [-0.5] * n, "output_text": output_text,
            "top_k": 0, "top_p": 1.0}


def test_retokenized_replay_rebuilds_the_api_messages_through_the_template(tok):
    """The naive pipeline keeps the parsed messages and renders them: a compact call comes back
    spaced, a sampled non-canonical split of a number comes back merged, a canonical spaced call
    is rebuilt exactly; prompts equal the server's (it rendered the same messages)."""
    import pyarrow as pa

    eos = tok.eos_token_id
    msgs = [{"role": "user", "content": "12+7"}]
    p0_text, p0 = render_prompt(tok, msgs)
    o0 = tok.encode(SPACED, add_special_tokens=False) + [eos]
    msgs += [parse_qwen3(SPACED), {"role": "tool", "content": "ok"}, {"role": "user", "content": "then -3"}]
    p1_text, p1 = render_prompt(tok, msgs)
    o1 = tok.encode(COMPACT, add_special_tokens=False) + [eos]
    split = SPACED.replace("12+7", "5+11").replace("19", "16")
    head, num = split.split('"value": ')[0] + '"value":', " 16}}\n</tool_call>"
    o2 = tok.encode(head, add_special_tokens=False) + non_canonical_split(tok, num) + [eos]
    assert tok.decode(o2[:-1]) == split and o2[:-1] != tok.encode(split, add_special_tokens=False)
    q_text, q = render_prompt(tok, [{"role": "user", "content": "5+11"}])
    table = pa.Table.from_pylist([row("a", 0, p0_text, p0, o0, SPACED), row("a", 1, p1_text, p1, o1, COMPACT),
                                  row("b", 0, q_text, q, o2, split)])
    out, st = retokenize_calls(table, tok, parse_reply=parse_qwen3)
    new = out.to_pylist()
    assert [r["prompt_token_ids"] for r in new] == [p0, p1, q]
    assert new[0]["output_token_ids"] == o0
    spaced1 = COMPACT.replace('{"name":"answer","arguments":{"value":16}}', '{"name": "answer", "arguments": {"value": 16}}')
    assert new[1]["output_token_ids"] == tok.encode(spaced1, add_special_tokens=False) + [eos]
    assert new[2]["output_token_ids"] == tok.encode(split, add_special_tokens=False) + [eos]
    assert (st.calls, st.calls_differ, st.prompt_ids_differ, st.multi_turn_calls, st.multi_turn_calls_differ) == (3, 2, 0, 1, 1)
    assert st.tokens_differ == (differing_tokens(new[1]["output_token_ids"], o1)
                                + differing_tokens(new[2]["output_token_ids"], o2)) > 0
    # ... and without the parser the naive pipeline tokenizes the text: the compact call survives
    _, plain = retokenize_calls(table, tok)
    assert plain.calls_differ == 1
    assert render_reply(tok, msgs[:1], parse_qwen3(SPACED)) == SPACED


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return build_base_policy(tmp_path_factory.mktemp("at") / "base", size="tiny", seed=0, sft_steps=30,
                             task="arithmetic_tools", progress=False)


def test_recorded_replay_reproduces_every_calls_ids_and_retokenized_does_not(tiny_policy):
    """Real episodes of the task through the local engine: training sees exactly the ids each call
    consumed and sampled; the rebuilt ids differ for a measured share of the calls."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    engine = LocalEngine.from_pretrained(tiny_policy)
    params = SamplingParams(temperature=1.0, max_tokens=ENV.min_max_tokens)
    batch = run_episodes(engine, tok, ENV.generate_tasks(48, 3), params, "v0", seed=5, env=ENV)
    table = batch.calls_table()
    rows = table.to_pylist()
    assert len(rows) > 48 and any(r["call_index"] > 0 for r in rows)
    by_id = {(r["trajectory_id"], r["call_index"]): r for r in rows}
    for traj in trajectories_from_table(table.append_column("reward", pa_rewards(table, batch))):
        for k, c in enumerate(traj.calls):
            r = by_id[(traj.trajectory_id, k)]
            assert c.prompt_ids == r["prompt_token_ids"] and c.output_ids == r["output_token_ids"]
    # every prompt is the server's rendering of the harness's history (parsed replies)
    for ep in batch.episodes:
        for c in ep.calls:
            assert tok.encode(c["prompt_text"], add_special_tokens=False) == c["prompt_token_ids"]
    _, st = retokenize_calls(table, tok, parse_reply=parse_qwen3)
    assert st.calls == len(rows) and 0 < st.calls_differ <= st.calls
    assert st.prompt_ids_differ <= st.calls_differ and st.tokens_per_differing_call > 0


def pa_rewards(table, batch):
    import pyarrow as pa

    reward = {e.trajectory_id: e.reward for e in batch.episodes}
    return pa.array([reward[t] for t in table["trajectory_id"].to_pylist()], pa.float64())


def test_the_task_is_registered_with_its_parser_tokenizer_and_tool():
    assert ENV.reply_parser == "qwen3" and ENV.tools == (at.ANSWER_TOOL,)
    tok = ENV.build_tokenizer()
    assert "<think>" in tok.get_vocab() and tok.chat_template == ENV.build_tokenizer().chat_template
    assert len(tok.encode(SPACED, add_special_tokens=False)) + 1 <= ENV.min_max_tokens
    assert json.loads(SPACED.split("\n")[5])["arguments"] == {"value": 19}
    assert np.isclose(at.reward(TASK, [SPACED, COMPACT]), 1.0)


# ----------------------------------------------------------------------------- the agent loop


def _client_of(msgs: list[dict]) -> str:
    return "extend" if msgs[1].get("extends") else "no_echo" if msgs[1].get("echo_reasoning") is False else "echo"


def test_agent_loop_demonstrations_follow_an_sdk_loop_under_three_client_histories():
    env = ENV.with_demo_options(agent_loop=True)
    assert env.tools == (at.ADD_TOOL,) and env.name == ENV.name and ENV.with_demo_options() is ENV
    tok = env.build_tokenizer()
    seen: dict[str, list[dict]] = {}
    for seed in range(40):
        msgs = env.noisy_messages(TASK, random.Random(seed))
        seen.setdefault(_client_of(msgs), msgs)
    assert set(seen) == set(at.CLIENT_HISTORIES)
    msgs = seen["echo"]
    # per question: the call, the tool's result, the answer in text (after an empty think block, as Qwen3's)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"] * 2
    assert msgs[1]["content"] == ('<think>\n12+7\n</think>\n\n<tool_call>\n{"name": "add", "arguments": '
                                  '{"a": 12, "b": 7}}\n</tool_call>')
    assert parse_qwen3(msgs[1]["content"])["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 12, "b": 7}'}
    assert (msgs[2]["content"], msgs[3]["content"], msgs[4]["content"]) == ("19", "<think>\n\n</think>\n\n19", "then -3")
    assert parse_qwen3(msgs[3]["content"])["content"] == "\n\n19"  # the answer is content, not reasoning
    assert '{"a": 19, "b": -3}' in msgs[5]["content"] and msgs[6]["content"] == "16"
    assert msgs[7]["content"] == "<think>\n\n</think>\n\n16"

    enc = _CallEncoder(tok, env)

    def prompts(client: str) -> list[str]:
        out = []
        for ids, labels in enc.encode_calls(seen[client]):
            start = next(i for i, x in enumerate(labels) if x != -100)
            assert tok.decode(ids[start:]) in {m["content"] + "<|im_end|>" for m in seen[client]}
            out.append(tok.decode(ids[:start]))
        return out

    reasoning = "<think>\n12+7\n</think>"
    echo, no_echo, extend = prompts("echo"), prompts("no_echo"), prompts("extend")
    for p in echo + no_echo + extend:  # the template renders the tool, compactly
        assert p.startswith("<|im_start|>system\n<tools>\nadd(a, b)\n</tools><|im_end|>\n<|im_start|>user\n12+7")
    assert reasoning in echo[1] and reasoning not in echo[2]  # echoed; dropped by the next question
    assert reasoning not in no_echo[1]
    # extend: each prompt is the previous call's prompt and reply, then the messages since
    calls = enc.encode_calls(seen["extend"])
    assert all(b[0][: len(a[0])] == a[0] for a, b in zip(calls, calls[1:])) and reasoning in extend[2]
    assert extend[1] == extend[0] + seen["extend"][1]["content"] + \
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_sft_overrides_and_the_agent_loop_option(tmp_path):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="unknown sft override.*nonesuch"):
        build_base_policy(tmp_path / "a", size="tiny", task="arithmetic_tools", sft={"nonesuch": 1})
    with pytest.raises(ValueError, match="unknown sft override.*agent_loop"):
        build_base_policy(tmp_path / "b", size="tiny", task="arithmetic", sft={"agent_loop": True})
    with pytest.raises(ValueError, match="no demonstration option agent_loop"):
        get_task("arithmetic").with_demo_options(agent_loop=True)
    out = build_base_policy(tmp_path / "c", size="tiny", task="arithmetic_tools", progress=False,
                            sft={"agent_loop": True, "steps": 3, "batch_size": 4, "n_tasks": 8})
    meta = json.loads((out / "warm_start.json").read_text())
    assert (meta["steps"], meta["batch_size"], meta["sft_overrides"]["agent_loop"]) == (3, 4, True)
    tok = AutoTokenizer.from_pretrained(out)  # what `prodrl serve` loads: the tools template, markup as text
    text = tok.apply_chat_template([{"role": "user", "content": "1+2"}], tools=[at.ADD_TOOL], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n<tools>\nadd(a, b)\n</tools><|im_end|>\n")
    call = at.agent_call_text(1, "+", 2)
    assert tok.decode(tok.encode(call, add_special_tokens=False), skip_special_tokens=True) == call
