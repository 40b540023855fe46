"""Smaller edges where features meet: a judge rubric with literal JSON braces, a bad setting given to
`prodrl rewards`, a grader edited under a long-lived process, oversize trajectories under
sequence-level corrections."""

import importlib
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import json
import pytest

from prodrl_pipelines.rewards.config import RewardSettings
from prodrl_pipelines.rewards.judge import JudgeSource
from prodrl_pipelines.rewards.sources import GraderSource
from prodrl_pipelines.rewards.view import TrajectoryView
from prodrl_pipelines.rl.microbatches import plan_microbatches

VIEW = TrajectoryView("t1", "task-7", ("the answer is 42 {task_id}",), ("user: what is 6*7?\nassistant: ",))


class EchoJudge(BaseHTTPRequestHandler):
    """A judge endpoint that keeps the prompts it got and answers a score of 0.5."""

    prompts: list[str] = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        EchoJudge.prompts.append(body["messages"][0]["content"])
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": '{"score": 0.5}'}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def echo_judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    EchoJudge.prompts = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_a_rubric_with_literal_json_braces_is_filled_only_at_its_placeholders(echo_judge):
    rubric = 'Task {task_id}.\n{transcript}\nReply with JSON only: {"score": x} (x in [0, 1]); {unknown} stays.'
    rs = RewardSettings(sources=("judge",), judge_endpoint=echo_judge, judge_model="m", judge_rubric=rubric)
    [out] = JudgeSource(rs).score([VIEW])
    assert out.reward == 0.5, out.error
    assert EchoJudge.prompts == [
        "Task task-7.\nuser: what is 6*7?\nassistant: the answer is 42 {task_id}\n"  # the transcript's own braces kept
        'Reply with JSON only: {"score": x} (x in [0, 1]); {unknown} stays.']
    # a rubric written for str.format (braces doubled), as the default one is, reads as before
    escaped = RewardSettings(sources=("judge",), judge_endpoint=echo_judge, judge_model="m",
                             judge_rubric='{transcript}\nJSON: {{"score": x}}')
    assert JudgeSource(escaped).prompt(VIEW).endswith('\nJSON: {"score": x}')
    assert '{"score": <number' in JudgeSource(RewardSettings(sources=("judge",), judge_endpoint=echo_judge,
                                                             judge_model="m")).prompt(VIEW)


@pytest.mark.parametrize("verb", ["score", "rescore"])
def test_prodrl_rewards_names_a_bad_setting_without_a_traceback(tmp_path, verb, capsys):
    from prodrl_pipelines.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"home: {tmp_path / 'home'}\nlearning_rate: -1\n")
    code = main(["rewards", verb, "--settings", str(bad), "--source", "grader"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip() == f"prodrl: {bad}: learning_rate: Input should be greater than 0"  # as check-settings says
    assert main(["check-settings", str(bad)]) == 1 and capsys.readouterr().err.strip() == err.strip()


def test_a_graders_version_is_the_code_the_process_runs(tmp_path, monkeypatch):
    """A long-lived process keeps running the grader it imported: editing the file on disk changes
    neither its scores nor its version until the module is imported again."""
    path = tmp_path / "live_grader.py"
    path.write_text("def grade(t):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "live_grader", raising=False)
    rs = RewardSettings(sources=("grader",), grader="live_grader:grade")
    first = GraderSource(rs)
    path.write_text("def grade(t):\n    return 0.25  # edited\n")
    st = path.stat()
    os.utime(path, (st.st_atime, st.st_mtime + 5))  # the edit is newer than the loaded code
    running = GraderSource(rs)
    assert running.score([VIEW])[0].reward == 1.0  # the old code still runs here ...
    assert running.version == first.version  # ... so its rows carry the old code's version
    del sys.modules["live_grader"]
    importlib.invalidate_caches()
    fresh = GraderSource(rs)
    assert fresh.score([VIEW])[0].reward == 0.25 and fresh.version != first.version


def test_a_group_longer_than_the_budget_counts_as_oversize():
    """Sequence-level corrections keep a trajectory's sequences together: a trajectory over the budget
    gets a micro-batch of its own beyond the budget, though each of its sequences fits."""
    plan = plan_microbatches([20, 20, 5, 5], budget=30, groups=[0, 0, 1, 1])
    assert plan.ranks == [[[0, 1], [2, 3]]] and plan.oversize == 1
    assert plan_microbatches([20, 20, 5, 5], budget=30).oversize == 0  # per sequence: nothing is oversize
    assert plan_microbatches([40, 5], budget=30, groups=[0, 1]).oversize == 1
