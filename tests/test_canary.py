"""A canary on live traffic: a round that passed its gate serves a sticky slice of trajectories beside
the champion; the canary sensor removes one that is worse on live reward (the champion keeps every
trajectory) and asks for the rollout of one that is as good, which then serves every replica. Real
``prodrl serve`` replicas, the recorder in front of them, rewards posted as feedback."""

from __future__ import annotations

import contextlib
import json
import math
import shutil

import httpx
import numpy as np
import pytest
from dagster import build_sensor_context

from prodrl_pipelines.deploy_targets import endpoint_file, make_target
from prodrl_pipelines.deploy_targets.processes import pick_port_range
from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.loop import canary, promotion
from prodrl_pipelines.loop.round_state import CANARY, CANARY_FAILED, DEPLOYED, round_state, utc_now
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.recorder.balancer import canary_share
from prodrl_pipelines.resources.settings import make_resources, open_services
from prodrl_pipelines.assets.partitions import ACTION_TAG, BY_TAG
from prodrl_pipelines.sensors import canary_sensor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_unpaired_lower_bound_is_the_normal_bound_and_covers():
    rng = np.random.default_rng(0)
    c, ch = rng.normal(0.6, 0.2, 40), rng.normal(0.5, 0.3, 90)
    diff, lower = canary.unpaired_lower_bound(c, ch, 1.645)
    se = math.sqrt(c.var(ddof=1) / 40 + ch.var(ddof=1) / 90)
    assert math.isclose(diff, c.mean() - ch.mean()) and math.isclose(lower, diff - 1.645 * se)
    # coverage (Monte Carlo): the one-sided 95% bound is below the true difference ~95% of the time
    hits = sum(canary.unpaired_lower_bound(rng.normal(0.6, 0.2, 40), rng.normal(0.5, 0.3, 90), 1.645)[1] <= 0.1
               for _ in range(4000))
    assert abs(hits / 4000 - 0.95) < 0.015


def test_judge_on_the_rewards_recorded_since_the_canary_started(tmp_path):
    from datetime import timedelta

    from prodrl_pipelines.config.settings import Settings
    from prodrl_pipelines.loop.ledger import LiveDeployment
    from prodrl_pipelines.loop.services import build_services
    from prodrl_pipelines.storage.locations import StoreLocation
    from tests.helpers import T0, make_call, make_reward

    svc = build_services(Settings(home=str(tmp_path), deploy={"canary_min_trajectories": 4}, eval={"gate_tolerance": 0.1}),
                         StoreLocation())
    svc.ledger.deploy(LiveDeployment("v0", str(tmp_path / "c"), str(tmp_path / "e")))
    start = T0 + timedelta(minutes=10)
    svc.ledger.record_decision("round-000001", {"passed": True, "canary": "running",
                                                "canary_started_us": int(start.timestamp() * 1e6)})

    def served(version, ids, minute, reward):
        svc.store.write_calls([make_call(t, policy_version=version, created_at=T0 + timedelta(minutes=minute)) for t in ids])
        svc.store.write_rewards([make_reward(t, r) for t, r in zip(ids, reward)])

    served("v0", [f"old{i}" for i in range(8)], 1, [0.0] * 8)  # the champion before the canary: not in the window
    served("v0", [f"c{i}" for i in range(8)], 11, [1.0, 0.9] * 4)
    served("round-000001", ["n0", "n1", "n2"], 12, [1.0, 0.9, 1.0])
    v = canary.judge(svc, "round-000001")
    assert v.passed is None and (v.n_candidate, v.needed) == (3, 4) and "3/4" in v.summary()
    served("round-000001", ["n3"], 13, [0.9])
    svc.store.write_calls([make_call("n4", policy_version="round-000001", created_at=T0 + timedelta(minutes=13))])  # no reward yet
    v = canary.judge(svc, "round-000001")
    assert v.passed and (v.n_candidate, v.n_champion) == (4, 8) and math.isclose(v.champion_mean, 0.95)
    assert math.isclose(v.diff, 0.0) and v.diff_lower < 0
    served("round-000001", [f"w{i}" for i in range(8)], 14, [0.0] * 8)  # worse from here on
    v = canary.judge(svc, "round-000001")
    assert v.passed is False and v.n_candidate == 12 and v.diff_lower < -0.1


FLEET = {"target": "prodrl-serve", "replicas": 2, "canary_fraction": 0.4, "canary_min_trajectories": 12,
         "export_scheme": "bf16", "probe_prompts": 0, "max_tokens": 4, "gate_tolerance": 0.05}


@contextlib.contextmanager
def running_fleet(tiny_policy_dir, home, **overrides):
    """Two ``prodrl serve`` replicas live on round-000000 (exports of round 1 and 2 ready, the same
    weights under other names) and a recorder following them: (services, resources, recorder, app)."""
    from prodrl_pipelines.quant.export import export_policy

    settings = {**FLEET, "home": str(home), "target_port": pick_port_range(6), **overrides}
    res = make_resources(settings)
    svc = open_services(res["settings"], res["store"], res["mlflow"])
    s = svc.settings
    for v in ("round-000000", "round-000001", "round-000002"):  # candidates: the same weights, other names
        shutil.copytree(tiny_policy_dir, s.checkpoints_root / v)
        export_policy(tiny_policy_dir, s.exports_root / v, "bf16")
    promotion.make_live(svc, "round-000000", by="bootstrap")
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                            store_dir=str(s.store_root), token="t", top_logprobs=4))
    with BackgroundServer(app) as rec:
        try:
            yield svc, res, rec, app
        finally:
            make_target(s).stop()


@pytest.fixture
def fleet(tiny_policy_dir, tmp_path):
    with running_fleet(tiny_policy_dir, tmp_path / "home") as f:
        yield f


def _traffic(rec, app, n: int, start: int, reward_of) -> dict[str, int]:
    """``n`` one-call trajectories through the recorder, each rewarded by ``reward_of(version)`` (none
    posted when it is None: scorers reward them); the versions that served them."""
    served: dict[str, int] = {}
    with httpx.Client(base_url=rec.url, headers={"Authorization": "Bearer t"}, timeout=60) as h:
        for i in range(start, start + n):
            tid = f"t{i}"
            r = h.post("/v1/completions", json={"model": "any", "prompt": [1, 5, 6], "max_tokens": 3},
                       headers={"X-Trajectory-Id": tid})
            assert r.status_code == 200, r.text
            v = r.json()["model"]
            served[v] = served.get(v, 0) + 1
            if reward_of is not None:
                f = h.post("/v1/feedback", json={"trajectory_id": tid, "reward": reward_of(v)})
                assert f.status_code == 200, f.text
    assert app.state.recorder.ingestor.flush(30)
    return served


def _gate_passed(svc, rkey):
    svc.ledger.record_decision(rkey, {"passed": True, "deployed": False, "review": "none"})
    svc.ledger.update_round(rkey, gate_passed=True)


@pytest.mark.long(seconds=95)
def test_a_worse_canary_is_removed_and_a_reviewer_promotes_the_next(fleet, pg_instance, capsys):
    svc, res, rec, app = fleet
    # round 1 passed its gate: a canary on 40% of trajectories, the champion keeps serving the rest
    _gate_passed(svc, "round-000001")
    out = promotion.deploy(svc, "round-000001")
    assert out.kind == "canary" and round_state(svc.ledger.decision("round-000001")) == CANARY
    ep = endpoint_file(svc.settings.home_path).read()
    assert ep.canary["policy_version"] == "round-000001" and ep.canary["fraction"] == 0.4
    assert promotion.deploy(svc, "round-000001").kind == "canary"  # a re-run changes nothing

    def ctx():
        return build_sensor_context(instance=pg_instance, resources=res)

    worse = {"round-000000": 1.0, "round-000001": 0.0}
    served = _traffic(rec, app, 12, 0, worse.get)
    # sticky by trajectory id: exactly the ids whose share is below the fraction went to the canary
    assert served.get("round-000001", 0) == sum(canary_share(f"t{i}") < 0.4 for i in range(12))
    skip = canary_sensor(ctx())
    if served.get("round-000001", 0) < 12:  # too few yet: the sensor says how many it has
        assert "rewarded candidate trajectories" in skip.skip_message
        served = _traffic(rec, app, 40, 12, worse.get)
    skip = canary_sensor(ctx())
    assert "canary failed" in skip.skip_message and "removed" in skip.skip_message, skip.skip_message
    d = svc.ledger.decision("round-000001")
    assert round_state(d) == CANARY_FAILED and not d["deployed"] and d["canary_verdict"]["candidate_mean"] == 0.0
    assert endpoint_file(svc.settings.home_path).read().canary is None
    assert make_target(svc.settings).canary() is None
    assert _traffic(rec, app, 10, 100, worse.get) == {"round-000000": 10}  # the champion serves everything
    assert svc.ledger.live().policy_version == "round-000000"

    # round 2: a reviewer ends its canary early with the CLI (promote); the sensor asks for its rollout
    _gate_passed(svc, "round-000002")
    assert promotion.deploy(svc, "round-000002").kind == "canary"
    from prodrl_pipelines.cli.main import main as prodrl
    from prodrl_pipelines.loop.services import publish_export

    run_id = svc.lineage.round_run("round-000002")
    version = svc.lineage.register_candidate(publish_export(svc, "round-000002", svc.settings.exports_root / "round-000002"),
                                             run_id, "round-000002", {"gate": "passed", "review": "none"})
    svc.ledger.update_round("round-000002", model_version=version)
    settings_file = svc.settings.home_path / "settings.json"
    settings_file.write_text(json.dumps({k: v for k, v in res["settings"].fields().items() if v is not None}))
    equal = {"round-000000": 1.0, "round-000002": 1.0}
    _traffic(rec, app, 6, 200, equal.get)
    assert "rewarded candidate trajectories" in canary_sensor(ctx()).skip_message  # too few for a verdict
    assert prodrl(["review", "end-canary", version, "--promote", "--settings", str(settings_file), "--by", "ann"]) == 0
    req = canary_sensor(ctx())
    assert req.tags[ACTION_TAG] == "canary_promote" and req.partition_key == "round-000002", req
    assert req.tags[BY_TAG] == "ann"
    out = promotion.deploy(svc, "round-000002", request=promotion.DeployRequest(
        "canary_promote", req.tags[BY_TAG], utc_now()))
    assert out.kind == "deployed" and svc.ledger.live().policy_version == "round-000002"
    d = svc.ledger.decision("round-000002")
    assert round_state(d) == DEPLOYED and d["canary"] == "passed" and d["decided_by"] == "ann"
    ep = endpoint_file(svc.settings.home_path).read()
    assert ep.canary is None and [r["policy_version"] for r in ep.replica_list()] == ["round-000002"] * 2
    assert make_target(svc.settings).canary() is None
    assert _traffic(rec, app, 6, 900, equal.get) == {"round-000002": 6}
    with pytest.raises(SystemExit) as ended:  # it is deployed now: no canary to end
        prodrl(["review", "end-canary", version, "--fail", "--settings", str(settings_file)])
    assert ended.value.code == 1 and "is not a running canary: deployed by ann" in capsys.readouterr().err

