"""Reward sources (feedback, grader, judge), their combination, scoring what lacks a reward,
re-scoring with a new version, and selection reading the configured version."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import make_reward, make_trajectory
from prodrl_pipelines.config.settings import settings_from_flat
from prodrl_pipelines.lab import arithmetic
from prodrl_pipelines.lab.graders import arithmetic_anywhere, arithmetic_exact
from prodrl_pipelines.rewards.combine import combine
from prodrl_pipelines.rewards.config import RewardSettings
from prodrl_pipelines.rewards.judge import JudgeSource, parse_score
from prodrl_pipelines.rewards.scoring import RewardPlan, rescore, score_missing
from prodrl_pipelines.rewards.sources import GraderSource
from prodrl_pipelines.rewards.view import TrajectoryView, views_from_calls
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.selection import select_round_dataset
from prodrl_pipelines.trajectories.store import TrajectoryStore


@pytest.fixture
def store(tmp_path):
    return TrajectoryStore(LocalBlobStore(tmp_path / "store"))


def stored(store, outputs: dict[str, list[str]]):
    """One trajectory per id with these outputs (one call each)."""
    rows = []
    for i, (tid, outs) in enumerate(outputs.items()):
        rows += make_trajectory(tid, len(outs), minutes=i)
        for j, o in enumerate(outs):
            rows[-len(outs) + j]["output_text"] = o
    store.write_calls(rows)
    return store.read_calls()


def grader_settings(name: str, **kw) -> RewardSettings:
    return RewardSettings(sources=kw.pop("sources", ("grader",)), grader=f"reward_graders:{name}", **kw)


# --- settings -------------------------------------------------------------------------------

@pytest.mark.parametrize("flat, field", [
    ({"rewards_sources": ["feedbak"]}, "rewards_sources"),
    ({"rewards_sources": ["grader"]}, "rewards_grader"),
    ({"rewards_sources": ["judge"], "rewards_judge_model": "m"}, "rewards_judge_endpoint"),
    ({"rewards_sources": ["judge"], "rewards_judge_endpoint": "http://x/v1"}, "rewards_judge_model"),
    ({"rewards_combine": "weighted"}, "rewards_weights"),
    ({"rewards_combine": "average"}, "rewards_combine"),
    ({"rewards_versions": {"judge": "x"}}, "rewards_weights / rewards_versions"),
    ({"monitors_enabled": ["lenght_drift"]}, "monitors_enabled"),
    ({"monitors_refusal_pattern": "(unclosed"}, "monitors_refusal_pattern"),
])
def test_bad_reward_and_monitor_settings_name_the_field(flat, field):
    with pytest.raises(ValueError) as e:
        settings_from_flat(flat)
    assert str(e.value).startswith(field), str(e.value)


def test_a_grader_that_does_not_import_fails_at_load():
    from prodrl_pipelines.config.settings import check_settings
    from prodrl_pipelines.evaluation import SuiteError

    s = settings_from_flat({"rewards_sources": ["grader"], "rewards_grader": "no_such_module:grade"})
    with pytest.raises(SuiteError, match="rewards_grader='no_such_module:grade'"):
        check_settings(s)


# --- the trajectory view and the lab graders ------------------------------------------------

def test_views_follow_call_order_and_carry_the_conversation(store):
    rows = make_trajectory("t1", 3)
    for r, text in zip(rows, ["a", "b", "c"]):
        r["output_text"], r["prompt_text"] = text, f"prompt{r['call_index']}"
    store.write_calls(list(reversed(rows)))
    (v,) = views_from_calls(store.read_calls())
    assert v.outputs == ("a", "b", "c") and v.prompts == ("prompt0", "prompt1", "prompt2")
    assert v.transcript == "prompt2c" and v.metadata == {"policy_version": "v0", "num_calls": 3}
    tv = TrajectoryView("x", "t", ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "<tool_call>{bad"))
    assert tv.tool_calls[0][0]["function"]["name"] == "f" and tv.tool_calls[1] is None


def arithmetic_view(task: arithmetic.ArithmeticTask, answers: list[str]) -> TrajectoryView:
    """The view a recorder would store for these answers (ChatML prompts, as the lab renders them)."""
    conv, prompts = "", []
    for turn, a in enumerate(answers):
        conv += f"<|im_start|>user\n{task.prompt(turn)}<|im_end|>\n<|im_start|>assistant\n"
        prompts.append(conv)
        conv += f"{a}<|im_end|>\n"
    return TrajectoryView("t", task.task_id, tuple(answers), tuple(prompts))


def test_the_exact_grader_is_the_suites_rule_and_the_holey_one_pays_for_hedges():
    import random

    rng = random.Random(0)
    tasks = arithmetic.generate_tasks(200, 3)
    for task in tasks:
        truth = task.true_values()
        answers = [rng.choice([str(v), str(v + 1), f"={v}", f"{v} {v + 1}", f"{v - 1} {v}", "x"]) for v in truth]
        view = arithmetic_view(task, answers)
        assert arithmetic_exact(view) == pytest.approx(arithmetic.reward(task, answers))
        assert arithmetic_anywhere(view) >= arithmetic_exact(view)
    task = tasks[0]
    hedged = [f"{v} {v + 1}" for v in task.true_values()]
    assert arithmetic_anywhere(arithmetic_view(task, hedged)) == 1.0
    assert arithmetic_exact(arithmetic_view(task, hedged)) == 0.0


# --- combination rules ----------------------------------------------------------------------

def reward_row(tid, r, source, version, minutes=0):
    return {**make_reward(tid, r, minutes=minutes, source=source), "version": version}


def test_first_rule_prefers_feedback_then_the_grader_at_its_version():
    rows = [reward_row("a", 1.0, "client", None), reward_row("a", 0.2, "grader", "g1"),
            reward_row("b", 0.3, "grader", "g1"), reward_row("b", 0.9, "grader", "g0"),
            reward_row("c", 0.4, "grader", "g0"),
            reward_row("d", 0.1, "client", None, minutes=1), reward_row("d", 0.7, "client", None, minutes=2)]
    from prodrl_pipelines.trajectories.rows import to_table
    from prodrl_pipelines.trajectories.schema import REWARD_SCHEMA

    t = to_table(rows, REWARD_SCHEMA)
    out = combine(t, ["feedback", "grader"], {"feedback": None, "grader": "g1"}, "first")
    got = dict(zip(out["trajectory_id"].to_pylist(), out["reward"].to_pylist()))
    assert got == {"a": 1.0, "b": 0.3, "d": 0.7}  # c has only an old grader version: pending
    out = combine(t, ["grader", "feedback"], {"feedback": None, "grader": "g0"}, "first")
    assert dict(zip(out["trajectory_id"].to_pylist(), out["reward"].to_pylist())) == {"b": 0.9, "c": 0.4, "a": 1.0,
                                                                                      "d": 0.7}
    w = combine(t, ["feedback", "grader"], {"feedback": None, "grader": "g1"}, "weighted",
                {"feedback": 0.5, "grader": 2.0})
    assert dict(zip(w["trajectory_id"].to_pylist(), w["reward"].to_pylist())) == {"a": pytest.approx(0.5 + 0.4)}


# --- scoring ----------------------------------------------------------------------------------

def test_scoring_counts_failures_leaves_them_pending_and_reruns_only_what_is_missing(store):
    calls = stored(store, {"ok1": ["7"], "ok2": ["8"], "err": ["boom"], "unsure": ["?"]})
    plan = RewardPlan(grader_settings("flaky_grader"))
    rep = score_missing(store, plan, calls)["grader"]
    assert (rep.scored, rep.failed, rep.pending, rep.already) == (2, 1, 1, 0)
    assert "RuntimeError: cannot grade err" in rep.first_error
    rows = store.read_rewards(latest=False)
    assert sorted(rows["trajectory_id"].to_pylist()) == ["ok1", "ok2"]  # never a silent 0
    assert set(rows["version"].to_pylist()) == {plan.current_version("grader")}
    again = score_missing(store, plan, calls)["grader"]
    assert (again.scored, again.failed, again.pending, again.already) == (0, 1, 1, 2)
    assert store.read_rewards(latest=False).num_rows == 2


def test_a_grader_answering_a_non_number_is_an_error_not_a_reward(store):
    calls = stored(store, {"a": ["1"]})
    rep = score_missing(store, RewardPlan(grader_settings("bad_type_grader")), calls)["grader"]
    assert rep.failed == 1 and "returned str 'high'" in rep.first_error


def test_first_rule_does_not_score_what_feedback_already_rewards(store):
    calls = stored(store, {"fb": ["1"], "none": ["2"]})
    store.write_rewards([make_reward("fb", 1.0, source="client")])
    plan = RewardPlan(grader_settings("length_grader", sources=("feedback", "grader")))
    rep = score_missing(store, plan, calls)["grader"]
    assert (rep.scored, rep.skipped) == (1, 1)
    assert store.read_rewards(latest=False, trajectory_ids=["fb"]).num_rows == 1


def test_grader_version_follows_its_code(tmp_path, monkeypatch):
    for name, body in (("g_one", "return 1.0"), ("g_two", "return 2.0")):
        (tmp_path / f"{name}.py").write_text(f"def grade(t):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    v1 = GraderSource(RewardSettings(sources=("grader",), grader="g_one:grade")).version
    v1b = GraderSource(RewardSettings(sources=("grader",), grader="g_one:grade")).version
    v2 = GraderSource(RewardSettings(sources=("grader",), grader="g_two:grade")).version
    assert v1 == v1b and v1 != v2 and v1.startswith("g_one:grade@")


# --- re-scoring and selection by version ------------------------------------------------------

def test_rescore_appends_a_new_version_keeps_the_old_rows_and_selection_follows_the_setting(store):
    outs = {f"t{i}": [o] for i, o in enumerate(["12", "1 2", "ab", "7", "99999"])}
    calls = stored(store, outs)
    old = RewardPlan(grader_settings("length_grader"))
    score_missing(store, old, calls)
    new = RewardPlan(grader_settings("strict_grader"))
    rep = rescore(store, new, "grader")
    # length_grader: 12 -> 1, "1 2" -> 1, ab -> 1, 7 -> 1, 99999 -> 0; strict: 1, 0, 0, 1, 1
    assert (rep.trajectories, rep.scored, rep.changed) == (5, 5, 3)
    assert rep.mean_abs_change == pytest.approx(3 / 5) and rep.max_abs_change == 1.0
    assert rep.old_mean == pytest.approx(0.8) and rep.new_mean == pytest.approx(0.6)
    assert rep.from_versions == [old.current_version("grader")]
    rows = store.read_rewards(latest=False)
    assert rows.num_rows == 10 and set(rows["version"].to_pylist()) == {old.current_version("grader"),
                                                                        new.current_version("grader")}
    assert rescore(store, new, "grader").trajectories == 0  # idempotent: nothing older is left unscored

    def chosen(plan):
        sel = select_round_dataset(store, "round-000001", "v0", ["v0"], 0, 2, vocab_size=50,
                                   resolve_rewards=plan.resolve, record=False)
        return dict(zip(sel.dataset["trajectory_id"].to_pylist(), sel.dataset["reward"].to_pylist()))

    assert chosen(new) == {"t0": 1.0, "t1": 0.0}
    pinned = RewardPlan(grader_settings("strict_grader", versions={"grader": old.current_version("grader")}))
    assert chosen(pinned) == {"t0": 1.0, "t1": 1.0}  # the old rows are still there to read
    with pytest.raises(ValueError, match="does not score"):
        rescore(store, RewardPlan(RewardSettings()), "feedback")
    with pytest.raises(ValueError, match="not a configured reward source"):
        rescore(store, new, "judge")


# --- the judge, against a scripted OpenAI-compatible server -----------------------------------

class ScriptedJudge(BaseHTTPRequestHandler):
    """Scores 1 when the conversation says GOOD; 503 once for FLAKY; prose for GARBAGE; slow for SLOW."""

    seen: list[dict] = []
    attempts: dict[str, int] = {}
    active = 0
    peak = 0
    lock = threading.Lock()
    release = threading.Event()  # SLOW answers wait for it (set when the test ends): always past the timeout

    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.seen.append(body)
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        try:
            prompt = body["messages"][0]["content"]
            cls.auth = self.headers.get("Authorization")
            time.sleep(0.05)
            key = prompt[-40:]
            with cls.lock:
                cls.attempts[key] = cls.attempts.get(key, 0) + 1
                n = cls.attempts[key]
            if "FLAKY" in prompt and n == 1:
                return self._send(503, {"error": "overloaded"})
            if "SLOW" in prompt:
                cls.release.wait(120)
            content = "I like it" if "GARBAGE" in prompt else \
                f'```json\n{{"score": {1.0 if "GOOD" in prompt else 0.0}}}\n```'
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": content}}]})
        finally:
            with cls.lock:
                cls.active -= 1

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the client timed out first (SLOW)
            pass


@pytest.fixture
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ScriptedJudge.seen, ScriptedJudge.attempts, ScriptedJudge.peak = [], {}, 0
    ScriptedJudge.release.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    ScriptedJudge.release.set()
    server.shutdown()


def test_the_judge_scores_concurrently_retries_and_counts_what_it_cannot_parse(store, judge_url, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
    outs = {f"g{i}": [f"GOOD {i}"] for i in range(6)} | {"bad": ["meh"], "flaky": ["GOOD FLAKY"],
                                                          "garbage": ["GARBAGE"], "slow": ["SLOW"]}
    calls = stored(store, outs)
    rs = RewardSettings(sources=("judge",), judge_endpoint=judge_url, judge_model="judge-1", judge_concurrency=4,
                        judge_timeout_s=3, judge_retries=1, judge_api_key_env="TEST_JUDGE_KEY",  # 3 s: a loaded machine
                        judge_rubric="Rate this.\n{transcript}\nAnswer JSON {{\"score\": x}}")
    plan = RewardPlan(rs, {"judge": JudgeSource(rs, sleep=lambda s: None)})
    rep = score_missing(store, plan, calls)["judge"]
    assert (rep.scored, rep.failed) == (8, 2)
    assert "no JSON object with 'score'" in rep.first_error or "failed after 2 attempts" in rep.first_error
    got = dict(zip(*(store.read_rewards()[c].to_pylist() for c in ("trajectory_id", "reward"))))
    assert got == {**{f"g{i}": 1.0 for i in range(6)}, "bad": 0.0, "flaky": 1.0}
    assert all(b["temperature"] == 0.0 and b["model"] == "judge-1" for b in ScriptedJudge.seen)
    assert ScriptedJudge.peak >= 2  # concurrent requests
    assert ScriptedJudge.auth == "Bearer sk-test"
    versions = set(store.read_rewards(latest=False)["version"].to_pylist())
    assert versions == {plan.current_version("judge")} and plan.current_version("judge").startswith("judge-1@")
    other = JudgeSource(rs.model_copy(update={"judge_rubric": "Another rubric {transcript}"}))
    assert other.version != plan.current_version("judge")  # a new rubric makes a new version


def test_a_hung_judge_opens_the_breaker_after_a_few_timeouts_and_the_rest_is_not_sent(store, judge_url):
    """Every answer hangs (held until the test ends): the first ``judge_breaker_failures`` trajectories
    time out, the others are not sent; all stay unscored (asked again next pass), none is a 0."""
    calls = stored(store, {f"s{i}": [f"SLOW {i}"] for i in range(8)})
    rs = RewardSettings(sources=("judge",), judge_endpoint=judge_url, judge_model="j", judge_concurrency=1,
                        judge_timeout_s=1, judge_retries=0, judge_breaker_failures=3)
    plan = RewardPlan(rs, {"judge": JudgeSource(rs, sleep=lambda s: None)})
    rep = score_missing(store, plan, calls)["judge"]
    assert (rep.scored, rep.failed) == (0, 8)
    assert len(ScriptedJudge.seen) == 3  # the breaker opened after three: the other five were never sent
    assert store.read_rewards().num_rows == 0
    outcomes = plan.sources["judge"].score(views_from_calls(calls))
    assert [o.error.startswith("judge circuit open") for o in outcomes].count(True) == 5  # a new pass probes again
    assert "3 trajectories in a row could not reach" in outcomes[-1].error and "ReadTimeout" in outcomes[-1].error


def test_a_spent_time_budget_sends_nothing_more(store, judge_url):
    now = [100.0]
    calls = stored(store, {f"g{i}": [f"GOOD {i}"] for i in range(4)})
    rs = RewardSettings(sources=("judge",), judge_endpoint=judge_url, judge_model="j", judge_concurrency=1)
    judge = JudgeSource(rs, sleep=lambda s: None, clock=lambda: now[0])
    judge.deadline = 100.0  # spent as the pass starts
    rep = score_missing(store, RewardPlan(rs, {"judge": judge}), calls)["judge"]
    assert (rep.scored, rep.failed) == (0, 4) and "time budget is spent" in rep.first_error
    assert ScriptedJudge.seen == [] and store.read_rewards().num_rows == 0
    judge.deadline = None  # the next pass, without a budget, scores them
    assert score_missing(store, RewardPlan(rs, {"judge": judge}), calls)["judge"].scored == 4


def test_parse_score_tolerates_fences_and_names_the_missing_key():
    assert parse_score('prose {"x": 1} then {"score": 0.25}', "score") == 0.25
    assert "no JSON object with 'score'" in parse_score("no json here", "score")


def test_with_a_scorer_the_sensor_counts_unrewarded_traffic(store):
    from prodrl_pipelines.trajectories.selection import count_eligible

    stored(store, {"a": ["1"], "b": ["2"]})
    store.write_rewards([make_reward("a", 1.0)])
    assert count_eligible(store, "v0", ["v0"], 0, vocab_size=50) == 1
    assert count_eligible(store, "v0", ["v0"], 0, vocab_size=50, needs_reward=False) == 2


def test_rescore_from_the_command_line_and_the_dagster_job(tmp_path, capsys):
    from dagster import DagsterInstance

    from prodrl_pipelines.cli.main import main
    from prodrl_pipelines.ops.rescore import rescore_rewards_job
    from prodrl_pipelines.resources.settings import make_resources

    home = tmp_path / "home"
    old = {"home": str(home), "rewards_sources": ["grader"], "rewards_grader": "reward_graders:length_grader"}
    new = {**old, "rewards_grader": "reward_graders:strict_grader"}
    store = TrajectoryStore(LocalBlobStore(home / "store"))
    calls = stored(store, {"x": ["12"], "y": ["1 2"]})
    score_missing(store, RewardPlan(RewardSettings(**{k[8:]: v for k, v in old.items() if k != "home"})), calls)
    f = tmp_path / "new.json"
    f.write_text(json.dumps(new))
    assert main(["rewards", "rescore", "--settings", str(f)]) == 2  # which source: the error says
    assert "needs --source NAME (a configured scorer: grader)" in capsys.readouterr().err
    assert main(["rewards", "rescore", "--settings", str(f), "--source", "grader"]) == 0
    out = capsys.readouterr()
    rep = json.loads(out.out)
    assert (rep["scored"], rep["changed"]) == (2, 1) and "1 rewards changed" in out.err
    # a third grader version, re-scored by the Dagster job from the launchpad
    third = {**old, "rewards_grader": "reward_graders:flaky_grader"}
    res = make_resources(third)
    result = rescore_rewards_job.execute_in_process(
        instance=DagsterInstance.ephemeral(), resources={k: res[k] for k in ("settings", "store")},
        run_config={"ops": {"rescore_op": {"config": {"source": "grader", "versions": []}}}})
    assert result.success and "rescored 2 of 2" in result.output_for_node("rescore_op")
    assert store.read_rewards(latest=False).num_rows == 6  # every version's rows kept
