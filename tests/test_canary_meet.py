"""Where canaries meet scored rewards and the Dagster daemon: a canary judged on the rewards a round
would train on (``RewardPlan``), its trajectories scored by the plan's scorers once complete, a verdict
that once acted on is final, and a canary run end to end through the daemon to automatic failure and
to automatic promotion on scored live reward."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from dagster import DagsterRun, build_sensor_context

from conftest import REPO
from prodrl_pipelines.assets.partitions import BY_TAG
from helpers import T0, make_call, make_reward
from prodrl_pipelines.config import environment
from prodrl_pipelines.config.settings import Settings, check_settings, settings_from_flat
from prodrl_pipelines.deploy_targets import endpoint_file
from prodrl_pipelines.loop import canary, promotion
from prodrl_pipelines.loop.ledger import LiveDeployment
from prodrl_pipelines.loop.round_state import CANARY, CANARY_FAILED, DEPLOYED, round_state, utc_now
from prodrl_pipelines.loop.services import build_services
from prodrl_pipelines.rewards.config import RewardSettings
from prodrl_pipelines.rewards.scoring import RewardPlan, score_missing
from prodrl_pipelines.sensors import RUN_KEY_TAG, canary_sensor
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.storage.locations import StoreLocation
from prodrl_pipelines.trajectories.store import TrajectoryStore
from test_canary import _gate_passed, _traffic, running_fleet

R1, R2 = "round-000001", "round-000002"
GRADED = {"rewards_sources": ["grader"], "rewards_grader": "canary_graders:worse_candidate"}


def _us(t: datetime) -> int:
    return int(t.timestamp() * 1_000_000)


# --- completion: a scorer rewards an episode once it is complete, on all its calls ---------------

def test_an_episode_is_scored_only_once_complete_then_on_all_its_calls(tmp_path):
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    plan = RewardPlan(RewardSettings(sources=("grader",), grader="reward_graders:length_grader"))  # idle: 300 s
    now = datetime.now(timezone.utc)

    def call(tid, i, text, at):
        c = make_call(tid, i, created_at=at)
        c["output_text"] = text
        return c

    # "ep": its first call (a short answer: length_grader's 1.0) is fresh, the episode is under way
    store.write_calls([call("ep", 0, "12", now)])
    rep = score_missing(store, plan, store.read_calls())["grader"]
    assert rep.scored == 0, "an episode under way was scored on its prefix"
    assert rep.in_flight == 1
    # its second call (too long: 0.0 for the whole episode); scored once it has been idle long enough
    store.write_calls([call("ep", 1, "a long answer", now + timedelta(seconds=1))])
    assert score_missing(store, plan, store.read_calls(), now_us=_us(now) + 30_000_000)["grader"].scored == 0
    rep = score_missing(store, plan, store.read_calls(), now_us=_us(now) + 302_000_000)["grader"]
    assert (rep.scored, rep.in_flight, rep.rewards) == (1, 0, [0.0])
    assert score_missing(store, plan, store.read_calls(), now_us=_us(now) + 303_000_000)["grader"].already == 1

    # "paused": idle long enough to be scored on one call, then the client goes on: the old grade is
    # stale (older than the episode's last call), so it is scored again, on both calls
    store.write_calls([call("paused", 0, "7", T0)])
    rep = score_missing(store, plan, store.read_calls(trajectory_ids=["paused"]))["grader"]
    assert rep.rewards == [1.0]
    store.write_calls([call("paused", 1, "a much longer answer", datetime.now(timezone.utc))])
    calls = store.read_calls(trajectory_ids=["paused"])
    assert score_missing(store, plan, calls)["grader"].in_flight == 1
    rep = score_missing(store, plan, calls, now_us=_us(datetime.now(timezone.utc)) + 301_000_000)["grader"]
    assert rep.rewards == [0.0]
    resolved = plan.resolve(store.read_rewards(latest=False, trajectory_ids=["paused"]))
    assert resolved.column("reward").to_pylist() == [0.0]

    # "told": the client posted its end-of-episode feedback (a label this plan does not read): complete now
    store.write_calls([call("told", 0, "3", now), call("told", 1, "4", now)])
    store.write_rewards([{"trajectory_id": "told", "reward": 0.5, "source": "done", "created_at": now}])
    rep = score_missing(store, plan, store.read_calls(trajectory_ids=["told"]))["grader"]
    assert (rep.scored, rep.in_flight, rep.rewards) == (1, 0, [1.0])


def test_idle_seconds_is_a_setting_with_a_default_and_a_floor():
    assert RewardSettings().idle_seconds == 300
    assert settings_from_flat({"rewards_idle_seconds": 5}).rewards.idle_seconds == 5
    with pytest.raises(ValueError, match="rewards_idle_seconds"):
        settings_from_flat({"rewards_idle_seconds": -1})


# --- the canary on the reward plan ----------------------------------------------------------------

def _canary_services(tmp_path, **rewards):
    svc = build_services(Settings(home=str(tmp_path), deploy={"canary_min_trajectories": 4},
                                  eval={"gate_tolerance": 0.1}, rewards=rewards), StoreLocation())
    svc.ledger.deploy(LiveDeployment("v0", str(tmp_path / "c"), str(tmp_path / "e")))
    start = T0 + timedelta(minutes=10)
    svc.ledger.record_decision(R1, {"passed": True, "canary": "running", "canary_started_us": _us(start)})
    return svc


def test_the_canary_is_judged_on_the_reward_plan_and_its_complete_trajectories_are_scored(tmp_path):
    svc = _canary_services(tmp_path, sources=("grader",), grader="canary_graders:worse_candidate")

    def served(version, ids, minute):  # clients label every trajectory 1.0: a label the plan does not read
        svc.store.write_calls([make_call(t, policy_version=version, created_at=T0 + timedelta(minutes=minute)) for t in ids])
        svc.store.write_rewards([make_reward(t, 1.0, minutes=minute) for t in ids])

    served("v0", [f"c{i}" for i in range(8)], 11)
    served(R1, [f"n{i}" for i in range(6)], 12)
    v = canary.judge(svc, R1)
    assert v.passed is None, f"judged on rewards the round would not train on: {v.summary()}"
    assert v.n_candidate == 0
    svc.store.write_calls([make_call("fresh", policy_version=R1, created_at=datetime.now(timezone.utc))])  # under way
    out = canary.score_completed(svc, R1)
    assert out["in_flight"] == 1 and out["sources"]["grader"]["scored"] == 14
    assert canary.score_completed(svc, R1)["sources"]["grader"]["scored"] == 0  # idempotent
    v = canary.judge(svc, R1)
    assert v.passed is False and (v.n_candidate, v.n_champion) == (6, 8)
    assert (v.candidate_mean, v.champion_mean) == (0.0, 1.0)


def test_the_canary_sensor_has_a_run_score_the_window_and_its_tick_only_judges(tmp_path, pg_instance):
    """With scorers in the plan the tick scores nothing itself (a slow or hung judge would hold it past
    Dagster's 60 s): it asks for a ``canary_scoring`` run of the round, none while one runs, and
    judges what is recorded. The run scores the window's complete trajectories and keeps its report
    beside the round; the next tick judges on them and fails the worse canary."""
    from dagster import DagsterRunStatus, RunRequest, SkipReason

    from prodrl_pipelines.ops.canary_scoring import CANARY_SCORING_JOB, canary_scoring_job
    from prodrl_pipelines.resources.settings import make_resources, open_services

    res = make_resources({"home": str(tmp_path / "home"), "target": "prodrl-serve", **GRADED, "canary_min_trajectories": 4,
                          "gate_tolerance": 0.1, "canary_scoring_every_s": 0})
    svc = open_services(res["settings"], res["store"], res["mlflow"])
    svc.ledger.deploy(LiveDeployment("round-000000", str(tmp_path / "c"), str(tmp_path / "e")))
    svc.ledger.update_round(R1, gate_passed=True)
    svc.ledger.record_decision(R1, {"passed": True, "canary": "running",
                                    "canary_started_us": _us(T0 + timedelta(minutes=10))})
    pg_instance.add_dynamic_partitions("rounds", [R1])
    svc.store.write_calls([make_call(f"c{i}", policy_version="round-000000", created_at=T0 + timedelta(minutes=11))
                           for i in range(8)] +
                          [make_call(f"n{i}", policy_version=R1, created_at=T0 + timedelta(minutes=12))
                           for i in range(6)])

    def tick():
        return canary_sensor(build_sensor_context(instance=pg_instance, resources=res))

    req = tick()
    assert isinstance(req, RunRequest) and req.job_name == CANARY_SCORING_JOB and req.partition_key == R1, req
    assert svc.store.read_rewards().num_rows == 0  # the tick scored nothing
    running = DagsterRun(job_name=CANARY_SCORING_JOB, run_id=str(uuid.uuid4()), status=DagsterRunStatus.STARTED,
                        tags={**req.tags, RUN_KEY_TAG: req.run_key})
    pg_instance.add_run(running)
    skip = tick()  # one at a time
    assert isinstance(skip, SkipReason) and "0/4 rewarded candidate trajectories" in skip.skip_message, skip
    pg_instance.delete_run(running.run_id)

    ran = canary_scoring_job.execute_in_process(partition_key=R1, resources=res, instance=pg_instance)
    assert ran.success
    report = canary.last_scoring(svc, R1)
    assert report["sources"]["grader"]["scored"] == 14 and report["run_id"] == ran.run_id
    skip = tick()  # judged on what the run scored: the grader finds the candidate worse
    d = svc.ledger.decision(R1)
    assert round_state(d) == CANARY_FAILED, skip
    v = d["canary_verdict"]
    assert (v["n_candidate"], v["n_champion"], v["candidate_mean"], v["champion_mean"]) == (6, 8, 0.0, 1.0)


def test_a_canary_no_reward_source_can_judge_is_refused_at_load(tmp_path):
    flat = {"home": str(tmp_path), "target": "prodrl-serve", "canary_fraction": 0.2, **GRADED}
    check_settings(settings_from_flat(flat))  # a scorer at its current version rewards the canary's traffic
    pinned = {**flat, "rewards_versions": {"grader": "an-older-version"}}
    with pytest.raises(ValueError, match="canary_fraction") as e:
        check_settings(settings_from_flat(pinned))
    assert "rewards_versions" in str(e.value) and "rewards_sources" in str(e.value)
    check_settings(settings_from_flat({**pinned, "canary_fraction": 0}))  # no canary: a pin only re-reads
    # the client's feedback first, the pinned grader after it: the canary can be judged on feedback
    check_settings(settings_from_flat({**pinned, "rewards_sources": ["feedback", "grader"]}))


# --- a verdict once acted on is final ---------------------------------------------------------------

@pytest.fixture
def fleet(tiny_policy_dir, tmp_path):
    with running_fleet(tiny_policy_dir, tmp_path / "home") as f:
        yield f


@pytest.mark.long(seconds=45)
def test_a_canary_whose_promotion_was_requested_is_never_failed(fleet, pg_instance, capsys):
    svc, res, rec, app = fleet
    _gate_passed(svc, R1)
    assert promotion.deploy(svc, R1).kind == "canary"

    def tick():
        return canary_sensor(build_sensor_context(instance=pg_instance, resources=res))

    equal = {"round-000000": 1.0, R1: 1.0}
    _traffic(rec, app, 40, 0, equal.get)
    req = tick()
    assert req.run_key == f"canary_promote-{R1}", req
    # the daemon records the run; before it deploys, the candidate turns worse and the bound moves
    pg_instance.add_run(DagsterRun(job_name="registry_decision", run_id=str(uuid.uuid4()),
                                   tags={**req.tags, RUN_KEY_TAG: req.run_key}))
    _traffic(rec, app, 60, 100, {"round-000000": 1.0, R1: 0.0}.get)
    assert canary.judge(svc, R1).passed is False  # a fresh judgement would fail it now
    skip = tick()
    assert round_state(svc.ledger.decision(R1)) == CANARY, f"a canary being promoted was failed: {skip.skip_message}"
    assert "rollout was requested" in skip.skip_message
    acted = svc.ledger.decision(R1)["canary_verdict"]  # what the first tick saw and acted on
    assert (acted["passed"], acted["n_candidate"], acted["candidate_mean"]) == (True, 12, 1.0)
    assert endpoint_file(svc.settings.home_path).read().canary["policy_version"] == R1
    with pytest.raises(canary.VerdictFinal):  # nor can anything else fail it
        canary.fail(svc, R1, canary.judge(svc, R1), "someone")
    # nor a reviewer: `prodrl review end-canary --fail` refuses
    from prodrl_pipelines.cli.main import main as prodrl
    from prodrl_pipelines.loop.services import publish_export

    version = svc.lineage.register_candidate(publish_export(svc, R1, svc.settings.exports_root / R1),
                                             svc.lineage.round_run(R1), R1, {"gate": "passed", "review": "none"})
    svc.ledger.update_round(R1, model_version=version)
    settings_file = svc.settings.home_path / "settings.json"
    settings_file.write_text(json.dumps({k: v for k, v in res["settings"].fields().items() if v is not None}))
    with pytest.raises(SystemExit) as refused:
        prodrl(["review", "end-canary", version, "--fail", "--settings", str(settings_file), "--by", "bob"])
    assert refused.value.code == 1 and "that verdict is final" in capsys.readouterr().err
    # the rollout records the verdict that was acted on, not a new one
    out = promotion.deploy(svc, R1, request=promotion.DeployRequest("canary_promote", req.tags[BY_TAG], utc_now()))
    assert out.kind == "deployed"
    d = svc.ledger.decision(R1)
    assert round_state(d) == DEPLOYED and d["canary"] == "passed" and d["canary_verdict"] == acted
    assert tick().skip_message == "no canary running"


# --- end to end through the Dagster daemon, on scored live reward -----------------------------------

def _wait(cond, what: str, log: Path, timeout_s: float = 600):  # a ceiling: daemon runs start slowly when loaded
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}; daemon log: {log.read_text(errors='replace')[-4000:]}")


@pytest.mark.long(seconds=90)
def test_canaries_through_the_daemon_fail_and_promote_on_scored_reward(tiny_policy_dir, tmp_path, pg_instance):
    overrides = {**GRADED, "rewards_idle_seconds": 1, "canary_min_trajectories": 8, "gate_tolerance": 0.5,
                 "canary_scoring_every_s": 1,  # the sensor's scoring runs, one at a time
                 "batch_size": 64, "steps_per_round": 64}  # no round starts from this traffic
    with running_fleet(tiny_policy_dir, tmp_path / "home", **overrides) as (svc, res, rec, app):
        settings = {k: v for k, v in res["settings"].fields().items() if v is not None}
        env = {**os.environ, **environment.write(settings=settings, home=settings["home"]),
               environment.SENSOR_INTERVAL: "2", environment.REGISTRY_INTERVAL: "1",
               "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
        pg_instance.add_dynamic_partitions("rounds", ["round-000000", R1, R2])
        # round 1 passed its gate: its canary starts (as its round's deployment step does)
        _gate_passed(svc, R1)
        assert promotion.deploy(svc, R1).kind == "canary"
        log = tmp_path / "daemon.log"
        with open(log, "wb") as fh:
            daemon = subprocess.Popen([str(Path(sys.executable).parent / "dagster-daemon"), "run", "-m",
                                       "prodrl_pipelines.definitions"], cwd=REPO, env=env, stdout=fh,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # no client posts a reward: the daemon's canary sensor grades what completed, then judges
            served = _traffic(rec, app, 40, 0, None)
            assert served.get(R1, 0) >= 8, served
            _wait(lambda: round_state(svc.ledger.decision(R1)) == CANARY_FAILED, "round 1's canary to fail", log)
            d = svc.ledger.decision(R1)
            v = d["canary_verdict"]
            assert (v["passed"], v["candidate_mean"], v["champion_mean"]) == (False, 0.0, 1.0), v
            assert d["decided_by"] == "canary (live reward)" and not d["deployed"]
            assert endpoint_file(svc.settings.home_path).read().canary is None
            assert svc.ledger.live().policy_version == "round-000000"

            # round 2 passed its gate: the grader finds it as good; the daemon's run rolls it out
            _gate_passed(svc, R2)
            assert promotion.deploy(svc, R2).kind == "canary"
            _traffic(rec, app, 30, 100, None)
            _wait(lambda: round_state(svc.ledger.decision(R2)) == DEPLOYED, "round 2's canary to be promoted", log)
            d = svc.ledger.decision(R2)
            assert d["canary"] == "passed" and d["canary_verdict"]["passed"] is True
            assert d["canary_verdict"]["n_candidate"] >= 8 and d["decided_by"] == "canary (live reward)"
            assert svc.ledger.live().policy_version == R2
            ep = endpoint_file(svc.settings.home_path).read()
            assert ep.canary is None and [r["policy_version"] for r in ep.replica_list()] == [R2] * 2
        finally:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        assert _traffic(rec, app, 4, 900, None) == {R2: 4}


# --- a canary the recorder paused (its server kept refusing connections) ----------------------------

@pytest.mark.long(seconds=40)
def test_a_canary_the_recorder_paused_waits_its_grace_then_is_failed_with_its_reason(fleet, pg_instance):
    """Paused by the recorder (its server refused connections): the verdict waits, with the reason, for
    ``canary_pause_grace_s`` (a restarted server is resumed by the recorder and judged as before);
    still paused after the grace, the canary is failed with that reason."""
    from datetime import datetime, timedelta, timezone

    from prodrl_pipelines.deploy_targets import make_target

    svc, res, rec, app = fleet
    _gate_passed(svc, R1)
    assert promotion.deploy(svc, R1).kind == "canary"
    ep = endpoint_file(svc.settings.home_path)
    url = ep.read().canary["replicas"][0]["url"]
    assert canary.paused(svc) is None
    # its server dies (else the recorder's health loop resumes the canary at once, as it should)
    os.killpg(make_target(svc.settings).canary().pid, signal.SIGKILL)
    reason = f"{url} could not be connected to 3 times in a row"
    ep.pause_canary(url, R1, reason)  # what the recorder writes (unless it already has)
    skip = canary_sensor(build_sensor_context(instance=pg_instance, resources=res))
    assert round_state(svc.ledger.decision(R1)) == CANARY, skip.skip_message  # a blip fails nothing
    assert "verdict waits" in skip.skip_message and "could not be connected" in skip.skip_message
    assert ep.resume_canary(url, R1)  # as when its server answers again
    assert len(ep.read().canary["pauses"]) == 1
    grace = svc.settings.deploy.canary_pause_grace_s
    long_ago = (datetime.now(timezone.utc) - timedelta(seconds=grace + 1)).isoformat()

    def paused_long_ago(e):  # paused again (the recorder may have done so already), longer than the grace
        e.canary["paused"] = {"reason": reason, "url": url, "at": long_ago}
        return e

    ep.update(paused_long_ago)
    skip = canary_sensor(build_sensor_context(instance=pg_instance, resources=res))
    d = svc.ledger.decision(R1)
    assert round_state(d) != CANARY and d["canary"] == "failed" and d["deployed"] is False, skip.skip_message
    assert "paused by the recorder" in d["canary_verdict"]["ended_by"] and "could not be connected" in skip.skip_message
    assert ep.read().canary is None  # removed: the champion serves every trajectory
    assert canary.running_canary(svc) is None
