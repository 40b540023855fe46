"""Scoring and re-scoring on a Ray Data actor pool (the session's two-node local Ray cluster): the
same rows as in-process, one commit per job that a re-run never repeats, a judge kept to its
concurrency per actor, a cluster running other grader code refused, and `prodrl rewards rescore`
and the Dagster rescore job run as Ray jobs."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from helpers import T0, make_call, make_reward
from prodrl_pipelines.cluster.local import LOOPBACK_ENV
from prodrl_pipelines.rewards.config import RewardSettings
from prodrl_pipelines.rewards.runners import Runner
from prodrl_pipelines.rewards.scoring import RewardPlan, commit_once, read_version, rescore, score_missing
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore

TESTS = str(Path(__file__).resolve().parent)
# Ray reads its loopback switch once, when first imported: set it before any test of this worker imports Ray
os.environ.update(LOOPBACK_ENV)
OUTPUTS = ["12", "1 2", "ab", "7", "99999", "x", "42", "3 4", "GOOD 5", "meh"]


def grader(name: str) -> RewardSettings:
    return RewardSettings(sources=("grader",), grader=f"reward_graders:{name}")


def seeded_store(root: Path, n: int, seed: int = 0) -> TrajectoryStore:
    """``n`` one-call trajectories with seeded outputs (built from one valid call row: cheap)."""
    store = TrajectoryStore(LocalBlobStore(root))
    base = make_call("t", 0, created_at=T0)
    picks = np.random.default_rng(seed).integers(0, len(OUTPUTS), n)
    store.write_calls([{**base, "trajectory_id": f"t{i:05d}", "task_id": f"task-{i % 97}", "prompt_text": f"q{i}: ",
                        "output_text": OUTPUTS[k]} for i, k in enumerate(picks)])
    return store


def rows(store: TrajectoryStore, version: str) -> list[tuple]:
    t = store.read_rewards(latest=False)
    return sorted((tid, r, s, v) for tid, r, s, v in zip(*(t[c].to_pylist() for c in
                                                         ("trajectory_id", "reward", "source", "version"))) if v == version)


def twin(store: TrajectoryStore, root: Path) -> TrajectoryStore:
    """A copy of the store: the same tables, history and application transactions."""
    shutil.copytree(store.blobs.root, root)
    return TrajectoryStore(LocalBlobStore(root))


@pytest.fixture
def ray_driver(ray_cluster):
    """This process as a driver of the session's cluster; its workers import the tests' graders."""
    import ray

    def init(pythonpath: str = TESTS):
        ray.init(address="127.0.0.1:" + ray_cluster.gcs_address.rpartition(":")[2], log_to_driver=False,  # GCS on loopback
                 runtime_env={"env_vars": {"PYTHONPATH": pythonpath, **LOOPBACK_ENV}})

    yield init
    ray.shutdown()


def test_rescoring_10000_trajectories_on_ray_data_equals_in_process_and_a_rerun_writes_nothing(tmp_path, ray_driver):
    ray_driver()
    here = seeded_store(tmp_path / "here", 10_000)
    score_missing(here, RewardPlan(grader("length_grader")), here.read_calls())
    there = twin(here, tmp_path / "there")
    new = RewardPlan(grader("strict_grader"))
    version = new.current_version("grader")

    t = time.monotonic()
    local = rescore(here, new, "grader")
    t_local = time.monotonic() - t
    runner = Runner("ray", 2)
    t = time.monotonic()
    on_ray = rescore(there, new, "grader", runner=runner)
    t_ray = time.monotonic() - t
    print(f"re-scoring 10,000: in-process {t_local:.1f}s, Ray Data 2 actors {t_ray:.1f}s, {runner.stats}")

    assert on_ray == local and on_ray.trajectories == 10_000 and on_ray.scored == 10_000
    assert 0 < on_ray.changed < 10_000
    assert rows(there, version) == rows(here, version)  # row for row
    assert len(runner.stats["workers"]) == 2 and runner.stats["batches"] >= 4  # both actors scored
    # one commit for the job, carrying its application transaction
    assert on_ray.committed_version == read_version(there)
    before = there.versions()
    again = rescore(there, new, "grader", runner=runner)
    assert (again.trajectories, again.committed_version) == (0, None) and there.versions() == before


def test_an_attempt_that_read_a_committed_jobs_snapshot_writes_nothing(tmp_path):
    """A retry overlapping the attempt that committed (both read version v) adds no rows; a later read,
    or another job, does."""
    store = TrajectoryStore(LocalBlobStore(tmp_path))
    store.write_rewards([make_reward("old")])
    v = read_version(store)
    new = [make_reward("a", 1.0), make_reward("b", 0.0)]
    assert commit_once(store, new, "prodrl-score-x", v) == v + 1
    assert commit_once(store, new, "prodrl-score-x", v) is None  # the same job from the same snapshot
    assert store.read_rewards(latest=False).num_rows == 3
    assert store.tables.txn_version("rewards", "prodrl-score-x") == v + 1
    assert commit_once(store, [make_reward("c")], "prodrl-score-y", v) == v + 2  # another job
    assert commit_once(store, [make_reward("a", 0.5)], "prodrl-score-x", read_version(store)) == v + 3
    assert commit_once(store, [], "prodrl-score-z", v) is None  # nothing to write: no commit


class DelayedJudge(BaseHTTPRequestHandler):
    """Answers after ``delay`` seconds: 1 when the conversation says GOOD, else 0; counts requests in flight."""

    delay = 0.1
    active = peak = calls = 0
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.active += 1
            cls.calls += 1
            cls.peak = max(cls.peak, cls.active)
        try:
            time.sleep(cls.delay)
            score = 1.0 if "GOOD" in body["messages"][0]["content"] else 0.0
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": f'{{"score": {score}}}'}}]})
        finally:
            with cls.lock:
                cls.active -= 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    @classmethod
    def reset(cls) -> None:
        cls.active = cls.peak = cls.calls = 0


@pytest.fixture
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), DelayedJudge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    DelayedJudge.reset()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_a_judge_on_ray_data_scores_like_in_process_with_bounded_concurrency_per_actor(tmp_path, ray_driver, judge_url):
    ray_driver()
    here = seeded_store(tmp_path / "here", 72, seed=1)
    there = twin(here, tmp_path / "there")
    rs = RewardSettings(sources=("judge",), judge_endpoint=judge_url, judge_model="judge-1", judge_concurrency=3,
                        judge_timeout_s=30, judge_retries=0)
    runner = Runner("ray", 2)
    on_ray = score_missing(there, RewardPlan(rs), there.read_calls(), runner=runner)["judge"]
    peak_ray, calls_ray = DelayedJudge.peak, DelayedJudge.calls
    DelayedJudge.reset()
    local = score_missing(here, RewardPlan(rs), here.read_calls())["judge"]
    version = RewardPlan(rs).current_version("judge")

    assert on_ray.as_dict() == local.as_dict() and (on_ray.scored, on_ray.failed) == (72, 0)
    assert rows(there, version) == rows(here, version) and calls_ray == 72
    assert len(runner.stats["workers"]) == 2
    # each actor keeps judge_concurrency requests in flight at most: the two together, twice that
    assert 3 < peak_ray <= 2 * 3, peak_ray
    assert DelayedJudge.peak <= 3
    before = there.versions()
    again = score_missing(there, RewardPlan(rs), there.read_calls(), runner=runner)["judge"]
    assert (again.scored, again.already) == (0, 72) and there.versions() == before


def test_a_cluster_running_other_grader_code_is_refused(tmp_path, ray_driver, monkeypatch):
    """The actors' grader hashes differently from the driver's: no row is written under the driver's version."""
    for side, body in (("driver", "return 1.0"), ("cluster", "return 0.0")):
        (tmp_path / side).mkdir()
        (tmp_path / side / "drift_grader.py").write_text(f"def grade(t):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "driver"))
    ray_driver(str(tmp_path / "cluster"))
    store = seeded_store(tmp_path / "s", 8)
    plan = RewardPlan(RewardSettings(sources=("grader",), grader="drift_grader:grade"))
    with pytest.raises(Exception, match="the cluster runs other code than the driver"):
        score_missing(store, plan, store.read_calls(), runner=Runner("ray", 1))
    assert store.read_rewards(latest=False).num_rows == 0


@pytest.mark.long(seconds=40)
def test_rescore_from_the_command_line_and_the_dagster_job_as_ray_jobs(tmp_path, ray_cluster, capsys):
    from dagster import DagsterInstance

    from prodrl_pipelines.cli.main import main
    from prodrl_pipelines.ops.rescore import rescore_rewards_job
    from prodrl_pipelines.resources.settings import make_resources

    home = tmp_path / "home"
    store = seeded_store(home / "store", 60, seed=2)
    score_missing(store, RewardPlan(grader("length_grader")), store.read_calls())
    mirror = twin(store, tmp_path / "mirror")
    on_ray = {"home": str(home), "rewards_sources": ["grader"], "rewards_grader": "reward_graders:strict_grader",
              "cluster": "ray", "cluster_address": ray_cluster.dashboard_url, "cluster_scoring_workers": 2,
              "cluster_runtime_env": json.dumps({"env_vars": {"PYTHONPATH": TESTS}})}
    f = tmp_path / "ray.json"
    f.write_text(json.dumps(on_ray))
    assert main(["rewards", "rescore", "--settings", str(f), "--source", "grader"]) == 0
    out = capsys.readouterr()
    rep = json.loads(out.out)
    assert "Ray job prodrl-rescore-cli-" in out.err
    local = rescore(mirror, RewardPlan(grader("strict_grader")), "grader")
    assert rep == local.__dict__
    version = RewardPlan(grader("strict_grader")).current_version("grader")
    assert rows(store, version) == rows(mirror, version) and rep["scored"] == 60
    # a bad source is refused before any job is submitted
    assert main(["rewards", "rescore", "--settings", str(f), "--source", "judge"]) == 2
    assert "not a configured reward source" in capsys.readouterr().err

    # a third grader version, re-scored by the Dagster job from the launchpad: a Ray job through Pipes
    third = {**on_ray, "rewards_grader": "reward_graders:flaky_grader"}
    res = make_resources(third)
    result = rescore_rewards_job.execute_in_process(
        instance=DagsterInstance.ephemeral(), resources={k: res[k] for k in ("settings", "store")},
        run_config={"ops": {"rescore_op": {"config": {"source": "grader", "versions": []}}}})
    assert result.success and "rescored 60 of 60" in result.output_for_node("rescore_op")
    assert store.read_rewards(latest=False).num_rows == 180  # every version's rows kept
