"""Suites and reward sources from the ecosystem: an external command, verifiers (its own
environment), inspect-ai. Each suite plays the tiny lab policy served by ``prodrl serve``'s app on a
loopback port and each reward source scores stored trajectories; the rewards are checked by hand
against the outputs they saw."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from helpers import make_trajectory
from prodrl_pipelines.config.settings import Settings
from prodrl_pipelines.evaluation import evaluate_policy, load_suite
from prodrl_pipelines.evaluation.suite import SuiteError
from prodrl_pipelines.rewards.config import RewardSettings
from prodrl_pipelines.rewards.scoring import RewardPlan, score_missing
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore


def eval_settings(n: int = 3, **eval_kw) -> Settings:
    return Settings(eval={"heldout_size": n, "eval_seed": 11, **eval_kw}, deploy={"max_tokens": 6})


def stored(tmp_path, trajectories: dict[str, tuple[str, list[str]]]):
    """Trajectories stored as recorded: id -> (task_id, one output per call)."""
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    rows = []
    for i, (tid, (task, outs)) in enumerate(trajectories.items()):
        calls = make_trajectory(tid, len(outs), minutes=i, task_id=task)
        for c, o in zip(calls, outs):
            c["output_text"] = o
        rows += calls
    store.write_calls(rows)
    return store, store.read_calls()


def decoded_outputs(policy_dir, calls) -> list[str]:
    """What the served calls sampled, as text (stop token dropped): the harness must report these."""
    from transformers import AutoTokenizer

    from prodrl_pipelines.evaluation.episodes import assistant_content, stop_token_ids

    tok = AutoTokenizer.from_pretrained(policy_dir)
    stops = stop_token_ids(tok, policy_dir)
    return [assistant_content(tok, out, stops) for _, out, _ in calls]


# ---------------------------------------------------------------------------------- external command

HARNESS = textwrap.dedent('''
    import json, os, sys
    from openai import OpenAI

    env = os.environ
    client = OpenAI(base_url=env["PRODRL_BASE_URL"], api_key=env["PRODRL_API_KEY"])
    print("harness starting", file=sys.stderr)
    for i in range(int(env["PRODRL_NUM_TASKS"])):
        r = client.chat.completions.create(
            model=env["PRODRL_MODEL"], messages=[{"role": "user", "content": f"{i} + {i} ="}],
            max_tokens=int(env["PRODRL_MAX_TOKENS"]), temperature=float(env["PRODRL_TEMPERATURE"]),
            top_p=float(env["PRODRL_TOP_P"]), seed=int(env["PRODRL_SEED"]) + i)
        text = r.choices[0].message.content
        print(json.dumps({"task_id": f"t{i}", "reward": float(len(text) % 2), "outputs": [text],
                          "tags": [f"parity:{i % 2}"], "gen_tokens": r.usage.completion_tokens}))
''')


@pytest.fixture
def harness(tmp_path) -> str:
    p = tmp_path / "harness.py"
    p.write_text(HARNESS)
    return f"command:{sys.executable} {p}"


def test_a_command_suite_plays_the_served_policy_and_feeds_the_gate_and_monitors(tiny_policy_dir, harness):
    settings = eval_settings(3, suite=harness)
    suite = load_suite(harness, "", settings)
    ev = evaluate_policy(settings, suite, tiny_policy_dir, "round-0007", keep_calls=True)
    assert ev["task_ids"] == ["t0", "t1", "t2"] and ev["num_tasks"] == 3 and ev["reward_errors"] == 0
    outs = [f["outputs"][0] for f in ev["facts"]]
    assert ev["rewards"] == [float(len(o) % 2) for o in outs]  # the harness's rule, by hand
    assert [f["tags"] for f in ev["facts"]] == [["parity:0"], ["parity:1"], ["parity:0"]]
    # the calls the loopback server answered are the episodes the harness reported, token for token
    assert len(ev["calls"]) == 3 and decoded_outputs(tiny_policy_dir, ev["calls"]) == outs
    assert [f["gen_tokens"] for f in ev["facts"]] == [len(c[1]) for c in ev["calls"]]
    again = evaluate_policy(settings, suite, tiny_policy_dir, "round-0007")  # seeded: the same episodes
    assert again["rewards"] == ev["rewards"] and [f["outputs"] for f in again["facts"]] == [[o] for o in outs]


@pytest.mark.parametrize("body, match", [
    ("import sys; print('boom', file=sys.stderr); sys.exit(3)", r"exited 3:\nboom"),
    ("print('progress 10%')", r"stdout line 1 is not JSON: 'progress 10%'"),
    ("print('{\"task_id\": \"a\"}')", r"line 1: 'reward' must be a number, got None"),
    ("print('{\"task_id\": \"a\", \"reward\": 1}'); print('{\"task_id\": \"a\", \"reward\": 0}')", "reported task 'a' twice"),
    ("print('{\"task_id\": \"a\", \"reward\": NaN}')", "task 'a': reward nan is not finite"),
])
def test_a_failing_command_fails_the_evaluation_naming_command_and_line(tmp_path, body, match):
    p = tmp_path / "bad.py"
    p.write_text(body)
    spec = f"command:{sys.executable} {p}"
    suite = load_suite(spec, "", eval_settings(2, suite=spec))
    ep = type("Endpoint", (), {"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key": "k"})()
    from prodrl_pipelines.engines.types import SamplingParams
    from prodrl_pipelines.evaluation.served import _play

    with pytest.raises(SuiteError, match=match):
        _play(suite, ep, 2, SamplingParams(), 0)


def test_command_and_source_settings_fail_at_load():
    with pytest.raises(SuiteError, match="name the command"):
        load_suite("command:", "", Settings())
    with pytest.raises(ValueError, match="rewards_command: source 'command' needs the command line"):
        RewardSettings(sources=("command",))
    with pytest.raises(ValueError, match="rewards_inspect_task: expected 'package.module:task'"):
        RewardSettings(sources=("inspect",), inspect_task="just_a_module")


SCORER = textwrap.dedent('''
    import json, sys
    for line in sys.stdin:
        t = json.loads(line)
        if t["task_id"] == "task-hard":
            print(json.dumps({"trajectory_id": t["trajectory_id"], "error": "cannot grade " + t["task_id"]}))
        elif t["task_id"] != "task-skip":
            print(json.dumps({"trajectory_id": t["trajectory_id"], "reward": float(t["outputs"][-1] == "4")}))
''')


def test_a_command_reward_source_scores_stored_trajectories(tmp_path):
    (tmp_path / "scorer.py").write_text(SCORER)
    store, calls = stored(tmp_path, {"a": ("task-x", ["1", "4"]), "b": ("task-x", ["5"]),
                                     "c": ("task-hard", ["4"]), "d": ("task-skip", ["4"])})
    plan = RewardPlan(RewardSettings(sources=("command",), command=f"{sys.executable} {tmp_path / 'scorer.py'}"))
    rep = score_missing(store, plan, calls)["command"]
    assert (rep.scored, rep.failed, rep.pending) == (2, 1, 1) and "cannot grade task-hard" in rep.first_error
    rows = store.read_rewards(latest=False).to_pylist()
    assert {r["trajectory_id"]: r["reward"] for r in rows} == {"a": 1.0, "b": 0.0}  # never a silent 0
    assert {r["version"] for r in rows} == {plan.current_version("command")}


# ------------------------------------------------------------------------------------------- verifiers

TINY_TASKSET = textwrap.dedent('''
    import verifiers.v1 as vf

    class QAData(vf.TaskData):
        answer: str

    class QATask(vf.Task[QAData]):
        @vf.reward(weight=1.0)
        async def exact(self, trace: vf.Trace) -> float:
            return 1.0 if trace.last_reply == self.data.answer else 0.0

    class QAConfig(vf.TasksetConfig):
        pass

    class TinyQA(vf.Taskset[QATask, QAConfig]):
        def load(self):
            for i, (q, a) in enumerate([("What is 2+2?", "4"), ("What is 3+4?", "7")]):
                yield QATask(QAData(id=f"q{i}", prompt=[vf.UserMessage(content=q)], answer=a), self.config.task)

    __all__ = ["TinyQA"]
''')


@pytest.fixture
def tiny_taskset(tmp_path, monkeypatch):
    """A two-task verifiers taskset ``tiny-qa`` in a temporary package on the bridge's PYTHONPATH."""
    from prodrl_pipelines.config import environment

    if not Path(environment.verifiers_python()).exists():
        msg = f"no verifiers environment at {environment.verifiers_python()}: `make verifiers` builds it"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    (tmp_path / "vfpkg" / "tiny_qa").mkdir(parents=True)
    (tmp_path / "vfpkg" / "tiny_qa" / "__init__.py").write_text(TINY_TASKSET)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "vfpkg"))
    return "tiny-qa"


def test_a_verifiers_taskset_is_a_suite_scored_by_its_own_task(tiny_policy_dir, tiny_taskset):
    spec = f"verifiers:{tiny_taskset}"
    settings = eval_settings(5, suite=spec)
    ev = evaluate_policy(settings, load_suite(spec, "", settings), tiny_policy_dir, "round-0003", keep_calls=True)
    assert ev["task_ids"] == ["q0", "q1"] and ev["reward_errors"] == 0  # the taskset holds two
    outs = [f["outputs"][0] for f in ev["facts"]]
    assert ev["rewards"] == [float(outs[0].strip() == "4"), float(outs[1].strip() == "7")]
    assert sorted(decoded_outputs(tiny_policy_dir, ev["calls"])) == sorted(outs)  # played concurrently


def test_the_verifiers_reward_source_scores_recorded_trajectories_by_task(tmp_path, tiny_taskset):
    store, calls = stored(tmp_path, {"a": ("q0", ["4"]), "b": ("q1", ["8"]), "c": ("q1", [" 7 "]),
                                     "d": ("nope", ["4"])})
    plan = RewardPlan(RewardSettings(sources=("verifiers",), verifiers_taskset=tiny_taskset))
    version = plan.current_version("verifiers")
    assert version.startswith("verifiers:tiny-qa@0.4.0+"), version  # the library and the taskset's code
    rep = score_missing(store, plan, calls)["verifiers"]
    assert (rep.scored, rep.failed) == (3, 1) and "'nope' is not a task of taskset 'tiny-qa'" in rep.first_error
    got = {r["trajectory_id"]: r["reward"] for r in store.read_rewards(latest=False).to_pylist()}
    assert got == {"a": 1.0, "b": 0.0, "c": 1.0}  # the taskset's rule: the stripped reply equals the answer
    # the taskset's package edited (its rubric): a new version, so rescore grades again
    init = tmp_path / "vfpkg" / "tiny_qa" / "__init__.py"
    init.write_text(init.read_text() + "\n# rubric edited\n")
    assert RewardPlan(RewardSettings(sources=("verifiers",), verifiers_taskset=tiny_taskset)
                      ).current_version("verifiers") != version


# ------------------------------------------------------------------------------------------- inspect-ai

TINY_TASK = textwrap.dedent('''
    from inspect_ai import Task, task
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import match
    from inspect_ai.solver import generate

    @task
    def tiny_arith():
        return Task(dataset=[Sample(input="What is 2+2?", target="4", id="q0", metadata={"kind": "add"}),
                             Sample(input="What is 3+4?", target="7", id="q1", metadata={"kind": "add", "tags": ["hard"]})],
                    solver=generate(), scorer=match())
''')


@pytest.fixture
def inspect_task(tmp_path, monkeypatch) -> str:
    (tmp_path / "ipkg").mkdir()
    (tmp_path / "ipkg" / "tiny_inspect_task.py").write_text(TINY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path / "ipkg"))
    return "tiny_inspect_task:tiny_arith"


def test_an_inspect_task_is_a_suite_and_its_scorer_a_reward_source_that_agrees(tiny_policy_dir, inspect_task, tmp_path):
    spec = f"inspect:{inspect_task}"
    settings = eval_settings(5, suite=spec)
    suite = load_suite(spec, "", settings)
    assert suite.calibration_messages(4, 0) == [[{"role": "user", "content": "What is 2+2?"}],
                                                [{"role": "user", "content": "What is 3+4?"}]]
    ev = evaluate_policy(settings, suite, tiny_policy_dir, "round-0005", keep_calls=True)
    assert ev["task_ids"] == ["q0", "q1"] and ev["reward_errors"] == 0
    assert [f["tags"] for f in ev["facts"]] == [["kind=add"], ["hard", "kind=add"]]
    outs = [f["outputs"][0] for f in ev["facts"]]
    # inspect saw what the policy sampled (its samples run concurrently: the calls in any order)
    assert sorted(decoded_outputs(tiny_policy_dir, ev["calls"])) == sorted(outs)
    assert sorted(f["gen_tokens"] for f in ev["facts"]) == sorted(len(c[1]) for c in ev["calls"])
    # the same outputs, recorded and scored by the reward source: the same rewards as inspect's own run
    store, calls = stored(tmp_path, {"e0": ("q0", [outs[0]]), "e1": ("q1", [outs[1]])})
    plan = RewardPlan(RewardSettings(sources=("inspect",), inspect_task=inspect_task))
    score_missing(store, plan, calls)
    got = {r["trajectory_id"]: r["reward"] for r in store.read_rewards(latest=False).to_pylist()}
    assert [got["e0"], got["e1"]] == ev["rewards"]


def test_the_inspect_reward_source_scores_recorded_outputs_by_hand(tmp_path, inspect_task):
    store, calls = stored(tmp_path, {
        "a": ("q0", ["4"]), "b": ("q0", ["8"]), "c": ("q1", ["let me add", "The answer is 7"]),
        "d": ("q1", ["<think>3 and 4</think>7"]), "e": ("q9", ["4"])})
    plan = RewardPlan(RewardSettings(sources=("inspect",), inspect_task=inspect_task))
    assert plan.current_version("inspect").startswith(f"inspect:{inspect_task}@")
    rep = score_missing(store, plan, calls)["inspect"]
    assert (rep.scored, rep.failed) == (4, 1) and "'q9' is not a sample of inspect task" in rep.first_error
    got = {r["trajectory_id"]: r["reward"] for r in store.read_rewards(latest=False).to_pylist()}
    # match(): the last output ends with the target; the reasoning block is the chat server's to strip
    assert got == {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0}


def test_bad_inspect_specs_fail_at_load(inspect_task):
    with pytest.raises(SuiteError, match="expected 'inspect:package.module:task'"):
        load_suite("inspect:tiny_inspect_task", "", Settings())
    with pytest.raises(SuiteError, match="has no attribute 'nope'"):
        load_suite("inspect:tiny_inspect_task:nope", "", Settings())
    with pytest.raises(SuiteError, match="expected an inspect Task or @task function, got str"):
        load_suite("inspect:textwrap:__doc__", "", Settings())


# --------------------------------------------------------------------------- in a round: gate and monitors

def test_a_served_suite_feeds_the_gate_the_monitors_and_the_slices(tiny_policy_dir, harness, tmp_path, monkeypatch):
    """Bootstrap on a command suite, then judge a candidate with the live weights: the paired gate,
    every monitor (the KL on the calls the loopback server answered) and the per-tag slices run on
    what the harness reported."""
    import shutil

    from prodrl_pipelines.loop import bootstrap, evaluate, gate
    from prodrl_pipelines.loop.services import services_from_env

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    svc = services_from_env({"home": str(tmp_path / "home"), "base_model": str(tiny_policy_dir), "eval_suite": harness,
                             "heldout_size": 4, "max_tokens": 6, "export_scheme": "bf16",
                             "monitors_slices_min_tasks": 2}, check=True)
    boot = bootstrap.bootstrap(svc)
    assert boot["reward_errors"] == 0
    live = svc.ledger.eval("round-000000")
    assert live["task_ids"] == ["t0", "t1", "t2", "t3"] and live["harness"] == harness
    exports = svc.settings.exports_root
    shutil.copytree(exports / "round-000000", exports / "round-000001")  # a candidate with the live weights
    res = evaluate.evaluate(svc, "round-000001")
    cand = res["candidate"]
    assert res["smoke_error"] == "" and cand["rewards"] == live["rewards"]  # seeded: the same episodes
    assert cand["kl_tokens"] == sum(f["gen_tokens"] for f in cand["facts"]) and abs(cand["kl_to_live"]) < 1e-4
    monitors = {m["name"]: m for m in res["monitors"]}
    assert set(monitors) == {"format_errors", "length_drift", "refusal_rate", "kl", "slices"}
    assert all(m["passed"] for m in monitors.values()), monitors
    assert "parity:0" in monitors["slices"]["detail"] and "parity:1" in monitors["slices"]["detail"]
    assert gate.heldout_verdict(svc, res).passed


# tasks reported in the reverse order when the served name ends in 1 (completion order differs between
# runs); a task's reward is its own (i/3), whatever the policy says
REVERSING = textwrap.dedent('''
    import json, os
    from openai import OpenAI

    env = os.environ
    client = OpenAI(base_url=env["PRODRL_BASE_URL"], api_key=env["PRODRL_API_KEY"])
    lines = []
    for i in range(int(env["PRODRL_NUM_TASKS"])):
        r = client.chat.completions.create(
            model=env["PRODRL_MODEL"], messages=[{"role": "user", "content": f"{i} + {i} ="}],
            max_tokens=int(env["PRODRL_MAX_TOKENS"]), seed=int(env["PRODRL_SEED"]) + i)
        lines.append(json.dumps({"task_id": f"t{i}", "reward": i / 3, "outputs": [r.choices[0].message.content],
                                 "tags": [f"half:{i // 2}"]}))
    for line in (lines[::-1] if env["PRODRL_MODEL"].endswith("1") else lines):
        print(line)
''')


def test_a_harness_reporting_in_another_order_is_paired_by_task(tiny_policy_dir, tmp_path, monkeypatch):
    """The candidate's harness run reports its tasks in reverse: the gate and the slices pair each task
    with itself (every difference 0), and live is not evaluated again for an order."""
    import shutil

    from prodrl_pipelines.loop import bootstrap, evaluate, gate
    from prodrl_pipelines.loop.services import services_from_env

    (tmp_path / "reversing.py").write_text(REVERSING)
    suite = f"command:{sys.executable} {tmp_path / 'reversing.py'}"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    svc = services_from_env({"home": str(tmp_path / "home"), "base_model": str(tiny_policy_dir), "eval_suite": suite,
                             "heldout_size": 4, "max_tokens": 4, "export_scheme": "bf16",
                             "monitors_slices_min_tasks": 2}, check=True)
    bootstrap.bootstrap(svc)
    assert svc.ledger.eval("round-000000")["task_ids"] == ["t0", "t1", "t2", "t3"]
    exports = svc.settings.exports_root
    shutil.copytree(exports / "round-000000", exports / "round-000001")  # a candidate with the live weights
    res = evaluate.evaluate(svc, "round-000001")
    assert res["candidate"]["task_ids"] == ["t3", "t2", "t1", "t0"]  # as the harness reported them
    assert res["live"]["task_ids"] == res["candidate"]["task_ids"]
    assert res["live"]["rewards"] == res["candidate"]["rewards"] == [1.0, 2 / 3, 1 / 3, 0.0]
    verdict = gate.heldout_verdict(svc, res)
    assert (verdict.mean_diff, verdict.diff_lower, verdict.diff_upper) == (0.0, 0.0, 0.0), verdict
    slices = next(m for m in res["monitors"] if m["name"] == "slices")
    assert "half:0: +0.000 [+0.000, +0.000]" in slices["detail"] and "half:1: +0.000" in slices["detail"], slices
    # the stored live evaluation is the bootstrap's: not run again because the order differed
    assert svc.ledger.eval("round-000000")["task_ids"] == ["t0", "t1", "t2", "t3"]


def test_evaluations_of_other_task_sets_are_refused_naming_the_difference():
    from prodrl_pipelines.evaluation.statistics import UnpairedEvaluations, paired_on

    ev = {"policy_version": "round-000002", "task_ids": ["a", "b", "c"], "rewards": [1, 2, 3],
          "facts": [{"x": 1}, {"x": 2}, {"x": 3}], "mean": 2.0}
    assert paired_on(ev, ["c", "a", "b"]) == {**ev, "task_ids": ["c", "a", "b"], "rewards": [3, 1, 2],
                                                "facts": [{"x": 3}, {"x": 1}, {"x": 2}]}
    with pytest.raises(UnpairedEvaluations, match=r"round-000002 ran other tasks .* missing \['d'\], extra \['c'\]"):
        paired_on(ev, ["a", "b", "d"])
    with pytest.raises(UnpairedEvaluations, match="missing"):
        paired_on(ev, ["a", "b"])
    # a task id twice (the lab's suites draw a task more than once): the k-th pairs with the k-th
    twice = {"task_ids": ["a", "b", "a"], "rewards": [1, 2, 3], "facts": [1, 2, 3]}
    assert paired_on(twice, ["a", "b", "a"]) is twice
    assert paired_on(twice, ["b", "a", "a"])["rewards"] == [2, 1, 3]
    with pytest.raises(UnpairedEvaluations):
        paired_on(twice, ["a", "b", "b"])


def test_live_monitoring_plays_a_served_suite_against_the_deployment_itself(tiny_policy_dir, harness):
    """Through an endpoint (``eval_live_endpoint``, the deployment's endpoint file) the harness talks
    to the deployment: a real ``prodrl serve`` process here, serving the live version's name."""
    import signal
    import subprocess

    from transformers import AutoTokenizer

    from helpers import wait_healthy
    from prodrl_pipelines.deploy_targets.processes import pick_port
    from prodrl_pipelines.engines.vllm_client import VLLMClient

    port = pick_port()
    proc = subprocess.Popen([sys.executable, "-m", "prodrl_pipelines.cli", "serve", str(tiny_policy_dir), "--port",
                             str(port), "--served-model-name", "round-0004", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", what="prodrl serve")
        settings = eval_settings(2, suite=harness)
        with VLLMClient(f"http://127.0.0.1:{port}", tokenizer=AutoTokenizer.from_pretrained(tiny_policy_dir)) as client:
            ev = evaluate_policy(settings, load_suite(harness, "", settings), tiny_policy_dir, "round-0004",
                                 engine=client, keep_calls=True)
        stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=60).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert ev["task_ids"] == ["t0", "t1"] and ev["calls"] == []  # the deployment keeps its calls to itself
    assert ev["rewards"] == [float(len(f["outputs"][0]) % 2) for f in ev["facts"]]
    assert stats["requests"] >= 2  # the harness's calls reached the deployment


def test_the_readme_examples_verifiers_taskset_scores_its_tasks(tmp_path, monkeypatch):
    """``examples/own_model/my_taskset`` (docs/evals.md), as the reward source: q1 is 1+3, q2 is 2+6."""
    from conftest import REPO

    from prodrl_pipelines.config import environment

    if not Path(environment.verifiers_python()).exists() and os.environ.get("CI") != "true":
        pytest.skip("no verifiers environment: `make verifiers` builds it")
    monkeypatch.setenv("PYTHONPATH", str(REPO / "examples" / "own_model"))
    store, calls = stored(tmp_path, {"a": ("q1", ["4"]), "b": ("q2", ["9"]), "c": ("q2", ["8 is the sum"])})
    plan = RewardPlan(RewardSettings(sources=("verifiers",), verifiers_taskset="my-taskset"))
    assert score_missing(store, plan, calls)["verifiers"].scored == 3
    got = {r["trajectory_id"]: r["reward"] for r in store.read_rewards(latest=False).to_pylist()}
    assert got == {"a": 1.0, "b": 0.0, "c": 1.0}  # the reply starts with the answer
