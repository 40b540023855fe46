"""Review in the MLflow registry, end to end: a real `mlflow server` (PostgreSQL backend, artifacts on
the S3 endpoint), the Dagster daemon on PostgreSQL running both sensors, `MlflowClient` and
`prodrl review` acting as reviewers. Approve, reject, roll back, the refused contradictions, and a
re-run of decided rounds that leaves every stored decision, tag and artifact byte-identical."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from dagster import AssetKey, RunsFilter, build_sensor_context, materialize
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file, save_file

from prodrl_pipelines.config import environment
from prodrl_pipelines.loop import review
from prodrl_pipelines.loop import round_state
from prodrl_pipelines.assets.gate import deployment_gate
from prodrl_pipelines.assets.round import (
    deployment, exported_policy, heldout_eval, recorded_trajectories, trained_checkpoint, training_batch,
)
from prodrl_pipelines.definitions import build_definitions
from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import MlflowResource, make_resources, open_services
from prodrl_pipelines.sensors import IN_FLIGHT, data_volume_sensor, registry_sensor
from prodrl_pipelines.loop.lineage import CHALLENGER, CHAMPION

from conftest import REPO

TINY = {"lab_size": "tiny", "lab_sft_steps": 30, "steps_per_round": 2, "batch_size": 4,
        "heldout_size": 12, "max_tokens": 6, "gate_tolerance": 0.5}
ROUND_ASSETS = [recorded_trajectories, training_batch, trained_checkpoint, exported_policy, heldout_eval, deployment]
MODEL = "prodrl-policy"


def consistent(client: MlflowClient, model: str = MODEL) -> None:
    """Every version's gate, review and deployed tags agree (checked at every poll)."""
    for mv in client.search_model_versions(f"name = '{model}'"):
        assert not review.tag_problems(mv.tags), (mv.version, mv.tags)


def wait_for(cond, what: str, log: Path, client: MlflowClient, timeout_s: float = 600):  # a ceiling (loaded machine)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        consistent(client)
        v = cond()
        if v:
            return v
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}; daemon log: {log.read_text(errors='replace')[-4000:]}")


def history(svc, client: MlflowClient, rkeys: list[str]) -> dict:
    """Every stored document, registry version and MLflow run (tags, metrics, end time, artifacts'
    bytes) of the given rounds."""
    out = {}
    for key in svc.blobs.list("rounds/"):
        if any(key.startswith(f"rounds/{r}/") for r in rkeys):
            out[key] = svc.blobs.get_bytes(key)
    for mv in client.search_model_versions(f"name = '{MODEL}'"):
        if mv.tags.get("prodrl.round") in rkeys:
            out[f"version {mv.version}"] = (sorted(mv.tags.items()), mv.description, sorted(mv.aliases))
    for r in rkeys:
        run = client.get_run(svc.ledger.round_summary(r)["mlflow_run_id"])
        out[f"run {r}"] = (run.info.status, run.info.end_time, sorted(run.data.tags.items()),
                           sorted(run.data.metrics.items()))
        with tempfile.TemporaryDirectory() as d:
            for a in client.list_artifacts(run.info.run_id, "plots"):
                out[f"run {r} {a.path}"] = Path(client.download_artifacts(run.info.run_id, a.path, d)).read_bytes()
    return out


def prodrl(capsys, settings_file: Path, *args: str) -> tuple[int, str, str]:
    """`prodrl ARGS --settings FILE` in this process (the environment carries the stores and the
    tracking server, as in a shell); returns (exit status, stdout, stderr)."""
    from prodrl_pipelines.cli import main as cli

    capsys.readouterr()
    try:
        rc = cli.main([*args, "--settings", str(settings_file)])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    out = capsys.readouterr()
    return rc, out.out, out.err


def s3_stores(endpoint: str, bucket: str) -> dict:
    return {"s3_bucket": bucket, "s3_prefix": "prodrl", "s3_endpoint_url": endpoint, "s3_region": "us-east-1"}


@pytest.mark.long(seconds=270)
def test_review_through_the_daemon(tmp_path, pg_instance, mlflow_server, s3_endpoint, bucket, capsys, monkeypatch):
    home = tmp_path / "home"
    settings = {**TINY, "home": str(home), "promotion": "review"}
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps(settings))
    stores = s3_stores(s3_endpoint, bucket)  # as `prodrl up` keeps them: the registry points at s3:// exports
    env = {**os.environ, **environment.write(settings=settings, store=stores, home=str(home)),
           environment.TRACKING_URI: mlflow_server, environment.SENSOR_INTERVAL: "2",
           environment.REGISTRY_INTERVAL: "2"}
    for k in ("PRODRL_S3_BUCKET", "PRODRL_S3_PREFIX", "PRODRL_S3_ENDPOINT_URL", "PRODRL_S3_REGION",
              environment.TRACKING_URI):
        monkeypatch.setenv(k, env[k])  # the reviewer's shell: `prodrl review` finds the same stores
    res = make_resources(settings, tracking_uri=mlflow_server, s3=stores)
    defs = build_definitions(res)
    svc = open_services(res["settings"], res["store"], res["mlflow"])
    client = MlflowClient(mlflow_server)
    assert defs.resolve_job_def("bootstrap").execute_in_process(instance=pg_instance).success
    assert svc.lineage.alias_version(CHAMPION) == "1"

    log = tmp_path / "daemon.log"
    with open(log, "wb") as fh:
        daemon = subprocess.Popen([str(Path(sys.executable).parent / "dagster-daemon"), "run", "-m",
                                   "prodrl_pipelines.definitions"], cwd=REPO, env=env, stdout=fh,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    def state(rkey: str) -> str | None:
        """The round's state once no run is in flight (a pending round's run ends after its gate)."""
        busy = pg_instance.get_run_records(RunsFilter(statuses=IN_FLIGHT), limit=1)
        return None if busy else round_state.round_state(svc.ledger.decision(rkey))
    try:
        # --- round 1 passes its gate and waits for review: nothing deployed
        simulate_traffic(svc, 8)
        wait_for(lambda: state("round-000001") == round_state.PENDING_REVIEW, "round 1 to await review", log, client)
        mv = client.get_model_version(MODEL, "2")
        assert (mv.tags["gate"], mv.tags["review"], mv.tags["deployed"]) == ("passed", "pending", "false")
        assert "round-000001: held-out reward" in mv.description and "awaiting review" in mv.description
        assert svc.lineage.alias_version(CHALLENGER) == "2" and svc.lineage.alias_version(CHAMPION) == "1"
        assert svc.ledger.live().policy_version == "round-000000"
        skip = data_volume_sensor(build_sensor_context(instance=pg_instance, definitions=defs, resources=res))
        assert "round-000001 awaits review: approve model version 2" in skip.skip_message
        assert pg_instance.get_latest_materialization_event(AssetKey("deployment")) is None

        # --- a reviewer in the MLflow UI: says who they are, then moves champion to it -> deployed
        client.set_model_version_tag(MODEL, "2", "review_by", "ann")
        client.set_registered_model_alias(MODEL, CHAMPION, "2")
        wait_for(lambda: state("round-000001") == round_state.DEPLOYED, "the approval to deploy round 1", log, client)
        assert svc.ledger.live().policy_version == "round-000001"
        d = svc.ledger.decision("round-000001")
        assert (d["review"], d["decided_by"]) == ("approved", "ann") and d["decided_at"]
        mv = client.get_model_version(MODEL, "2")
        assert (mv.tags["review"], mv.tags["deployed"], mv.tags["decided_by"]) == ("approved", "true", "ann")
        mat = pg_instance.get_latest_materialization_event(AssetKey("deployment")).asset_materialization
        assert mat.partition == "round-000001" and mat.metadata["how"].value == "deployed"
        assert mat.metadata["model_version"].value.startswith(f"{mlflow_server}/#/models/{MODEL}/versions/2")

        # --- round 2, on traffic from the newly deployed round 1, is rejected with the CLI
        simulate_traffic(svc, 8)
        wait_for(lambda: state("round-000002") == round_state.PENDING_REVIEW, "round 2 to await review", log, client)
        assert svc.ledger.round_summary("round-000002")["trained_from"] == "round-000001"
        rc, _, err = prodrl(capsys, settings_file, "review", "reject", "3", "--reason", "answers too short", "--by", "bob")
        assert rc == 0, err
        wait_for(lambda: state("round-000002") == round_state.REJECTED, "the rejection of round 2", log, client)
        d = svc.ledger.decision("round-000002")
        assert (d["decided_by"], d["review_reason"], d["deployed"]) == ("bob", "answers too short", False)
        assert svc.ledger.live().policy_version == "round-000001"
        rc, _, err = prodrl(capsys, settings_file, "review", "approve", "3", "--by", "bob")  # two decisions, one round
        assert rc == 1 and "not awaiting review: rejected by bob" in err

        # --- contradictions written straight into the registry are refused on the version
        client.set_model_version_tag(MODEL, "3", "review", "approved")
        # the refusal is two tag writes (the restored review, then review_refused): wait for the state
        # they leave together, then check what it says
        tags = lambda: client.get_model_version(MODEL, "3").tags  # noqa: E731
        wait_for(lambda: "review_refused" in tags() and tags()["review"] == "rejected", "a refusal", log, client)
        assert "its round is decided (rejected by bob" in tags()["review_refused"]
        client.set_registered_model_alias(MODEL, CHAMPION, "3")  # "roll back" to a version never deployed
        wait_for(lambda: "never deployed" in client.get_model_version(MODEL, "3").tags["review_refused"],
                 "the refused rollback", log, client)
        assert svc.lineage.alias_version(CHAMPION) == "2" and svc.ledger.live().policy_version == "round-000001"

        # --- roll back to the base policy with the CLI: deployed again, recorded as a rollback
        rc, _, err = prodrl(capsys, settings_file, "review", "rollback", "3", "--by", "carol")
        assert rc == 1 and "was never deployed" in err
        rc, _, err = prodrl(capsys, settings_file, "review", "rollback", "1", "--by", "carol")
        assert rc == 0, err
        def rolled_back() -> bool:  # the live pointer moves first; the registry tags and the materialisation follow
            ev = pg_instance.get_latest_materialization_event(AssetKey("deployment"))
            return (svc.ledger.live().policy_version == "round-000000"
                    and "rollback.1" in client.get_model_version(MODEL, "1").tags
                    and ev is not None and ev.asset_materialization.partition == "round-000000")

        wait_for(rolled_back, "the rollback", log, client)
        live = svc.ledger.live()
        assert (live.kind, live.decided_by, live.model_version) == ("rollback", "carol", "1")
        events = svc.ledger.events()
        assert [(e["policy_version"], e["kind"]) for e in events] == [
            ("round-000000", "deploy"), ("round-000001", "deploy"), ("round-000000", "rollback")]
        assert svc.ledger.version_order() == ["round-000001", "round-000000"]
        mv = client.get_model_version(MODEL, "1")
        assert json.loads(mv.tags["rollback.1"])["from"] == "round-000001"
        mat = pg_instance.get_latest_materialization_event(AssetKey("deployment")).asset_materialization
        assert (mat.partition, mat.metadata["rollback"].value, mat.metadata["decided_by"].value) == (
            "round-000000", True, "carol")

    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()

    # --- the next round trains from the rolled-back checkpoint on its traffic; approved with the CLI
    # (in this process from here on: the sensors are the same functions, without a run launch each)
    simulate_traffic(svc, 8)
    tick = data_volume_sensor(build_sensor_context(instance=pg_instance, definitions=defs, resources=res))
    for add in tick.dynamic_partitions_requests:
        pg_instance.add_dynamic_partitions(add.partitions_def_name, list(add.partition_keys))
    assert tick.run_requests[0].partition_key == "round-000003"
    assert defs.resolve_job_def("prod_rl_round").execute_in_process(
        instance=pg_instance, partition_key="round-000003", tags=tick.run_requests[0].tags).success
    assert state("round-000003") == round_state.PENDING_REVIEW
    assert svc.ledger.round_summary("round-000003")["trained_from"] == "round-000000"
    rc, out, err = prodrl(capsys, settings_file, "review", "list", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert (rows[0]["version"], rows[0]["state"]) == ("4", "pending_review")
    assert rows[0]["monitors"] != "-"  # the reviewer sees the behaviour monitors beside the reward
    mv_tags = client.get_model_version(svc.lineage.model_name, "4").tags
    assert {f"monitor.{n}" for n in ("format_errors", "length_drift", "refusal_rate", "kl", "slices")} <= set(mv_tags)
    assert {r["version"]: r["live"] for r in rows}["1"] is True
    rc, out, _ = prodrl(capsys, settings_file, "review", "list")
    assert out.splitlines()[1].split()[:3] == ["4", "round-000003", "pending_review"] and "*1" in out
    assert "monitors" in out.splitlines()[0]
    rc, _, err = prodrl(capsys, settings_file, "review", "approve", "4", "--by", "dan")
    assert rc == 0, err
    req = registry_sensor(build_sensor_context(instance=pg_instance, definitions=defs, resources=res)).run_requests[0]
    assert (req.tags["prodrl/review-action"], req.tags["prodrl/review-by"]) == ("approve", "dan")
    assert defs.resolve_job_def("registry_decision").execute_in_process(
        instance=pg_instance, partition_key=req.partition_key, tags=req.tags).success
    assert state("round-000003") == round_state.DEPLOYED and svc.ledger.live().policy_version == "round-000003"
    assert svc.lineage.alias_version(CHAMPION) == "4"
    consistent(client)

    # --- decided rounds re-run from the Launchpad: nothing stored changes
    rkeys = ["round-000001", "round-000002", "round-000003"]
    before = history(svc, client, rkeys)
    rerun = materialize([*ROUND_ASSETS, deployment_gate], selection=[heldout_eval, deployment_gate, deployment],
                        instance=pg_instance, partition_key="round-000001", resources=res, raise_on_error=False)
    failed = rerun.get_step_failure_events()
    assert [e.step_key for e in failed] == ["deployment"]
    assert "to roll back to it, move the registry alias champion to its model version (2)" in \
        failed[0].event_specific_data.error.to_string()
    ev = rerun.asset_materializations_for_node("heldout_eval")[0].metadata
    assert ev["reproduced"].value is True
    again = materialize(ROUND_ASSETS, selection=[exported_policy], instance=pg_instance,
                        partition_key="round-000002", resources=res, raise_on_error=False)
    assert "round-000002 is decided (rejected by bob" in again.get_step_failure_events()[0].event_specific_data.error.to_string()
    live_again = materialize(ROUND_ASSETS, selection=[deployment], instance=pg_instance,
                             partition_key="round-000003", resources=res)
    assert live_again.asset_materializations_for_node("deployment")[0].metadata["reproduced"].value is True
    assert history(svc, client, rkeys) == before
    # an explicit re-evaluation is stored beside the original
    rc, out, err = prodrl(capsys, settings_file, "eval", "--policy", "round-000001")
    assert rc == 0, err
    stored = json.loads(out)["stored_at"]
    assert stored.startswith("rounds/round-000001/reevaluations/") and svc.blobs.exists(stored)


@pytest.mark.long(seconds=55)
def test_refused_contradictions_in_one_tick(tmp_path, pg_instance, mlflow_server, s3_endpoint, bucket, monkeypatch):
    """A gate-failed version approved, approve and reject at once, a state that is none: each is
    refused with a message on the version and in the sensor's skip reason."""
    res = make_resources({**TINY, "home": str(tmp_path / "home"), "promotion": "review"}, tracking_uri=mlflow_server,
                         s3=s3_stores(s3_endpoint, bucket))
    res["mlflow"] = MlflowResource(tracking_uri=mlflow_server, experiment="refusals", model_name="refusals-policy")
    defs = build_definitions(res)
    svc = open_services(res["settings"], res["store"], res["mlflow"])
    lin = svc.lineage
    assert defs.resolve_job_def("bootstrap").execute_in_process(instance=pg_instance).success

    def tick(cursor=None):
        return registry_sensor(build_sensor_context(instance=pg_instance, definitions=defs, resources=res, cursor=cursor))

    # round 1: its export is corrupted after registration (NaN in a norm weight): the gate fails
    simulate_traffic(svc, 8)
    pg_instance.add_dynamic_partitions("rounds", ["round-000001"])
    assert materialize(ROUND_ASSETS[:4], instance=pg_instance, partition_key="round-000001", resources=res).success
    failed_version = lin.alias_version(CHALLENGER)
    export = svc.settings.exports_root / "round-000001" / "model.safetensors"
    sd = load_file(export)
    sd[next(k for k in sd if k.endswith("norm.weight"))][0] = float("nan")
    save_file(sd, export, metadata={"format": "pt"})
    out = materialize([*ROUND_ASSETS, deployment_gate], selection=[heldout_eval, deployment_gate, deployment],
                      instance=pg_instance, partition_key="round-000001", resources=res, raise_on_error=False)
    assert not out.success
    assert round_state.round_state(svc.ledger.decision("round-000001")) == round_state.GATE_FAILED
    assert lin.version(failed_version).tags["gate"] == "failed"
    lin.tag_version(failed_version, {"review": "approved"})  # approve a version whose gate failed
    msg = tick().skip_message
    assert f"review=approved on version {failed_version} ignored: its round is decided (gate failed: non-finite" in msg
    mv = lin.version(failed_version)
    assert mv.tags["review"] == "none" and "gate failed" in mv.tags["review_refused"]

    # round 2: trains from live (round 0), passes, waits for review
    simulate_traffic(svc, 8)
    pg_instance.add_dynamic_partitions("rounds", ["round-000002"])
    out = materialize([*ROUND_ASSETS, deployment_gate], instance=pg_instance, partition_key="round-000002",
                      resources=res)
    assert out.success and not out.asset_materializations_for_node("deployment")
    assert round_state.round_state(svc.ledger.decision("round-000002")) == round_state.PENDING_REVIEW
    pending = lin.alias_version(CHALLENGER)
    assert "no pending decision" in tick().skip_message
    # ticks between the gate's decision in the ledger and its tags on the version (those of its
    # registration, then the gate's first): nothing to act on, nothing refused
    for tags in ({"review": "none", "gate": "pending"}, {"gate": "passed"}):
        lin.tag_version(pending, tags)
        assert "no pending decision" in tick().skip_message
        assert "review_refused" not in lin.version(pending).tags and lin.version(pending).tags["review"] == "none"
    lin.tag_version(pending, {"review": "pending"})  # as the gate's step goes on to write it

    # approve and reject at once: refused, the registry put back to pending
    lin.tag_version(pending, {"review": "rejected"})
    lin.promote(pending)
    msg = tick().skip_message
    assert "contradictory review of round-000002" in msg
    mv = lin.version(pending)
    assert mv.tags["review"] == "pending" and "contradictory" in mv.tags["review_refused"]
    assert lin.alias_version(CHAMPION) == "1"
    # a state that is no review state
    lin.tag_version(pending, {"review": "maybe"})
    assert "'maybe' is not a review state" in tick().skip_message
    assert lin.version(pending).tags["review"] == "pending"
    # a reviewer's edit that lands while a tick runs, after the tick's own rewrite, is not lost: the
    # next tick sees it (the cursor is the state the tick started from)
    real_refusal = review.apply_refusal

    def refusal_then_an_edit(svc_, action):
        real_refusal(svc_, action)
        lin.tag_version(pending, {"review": "maybe-again"})

    monkeypatch.setattr(review, "apply_refusal", refusal_then_an_edit)
    lin.tag_version(pending, {"review": "maybe"})
    registry_sensor(racing := build_sensor_context(instance=pg_instance, definitions=defs, resources=res))
    monkeypatch.undo()
    assert "'maybe-again' is not a review state" in tick(racing.cursor).skip_message
    assert lin.version(pending).tags["review"] == "pending"
    # the cursor: an unchanged registry is a cheap skip
    result = registry_sensor(ctx := build_sensor_context(instance=pg_instance, definitions=defs, resources=res))
    assert "no pending decision" in result.skip_message
    assert "registry unchanged" in registry_sensor(build_sensor_context(
        instance=pg_instance, definitions=defs, resources=res, cursor=ctx.cursor)).skip_message
    # nothing of this touched the live deployment
    assert svc.ledger.live().policy_version == "round-000000"
    assert [e["kind"] for e in svc.ledger.events()] == ["deploy"]

    def run(req, resources):
        return build_definitions(resources).resolve_job_def("registry_decision").execute_in_process(
            instance=pg_instance, partition_key=req.partition_key, tags=req.tags, raise_on_error=False)

    # approve in the UI way, deployed; then a rollback to the base whose deploy fails: champion comes back
    lin.promote(pending)
    assert run(tick().run_requests[0], res).success
    assert svc.ledger.live().policy_version == "round-000002"
    lin.promote("1")
    result = tick()
    for add in result.dynamic_partitions_requests:  # as the daemon applies a sensor's result
        pg_instance.add_dynamic_partitions(add.partitions_def_name, list(add.partition_keys))
    req = result.run_requests[0]
    assert req.tags["prodrl/review-action"] == "rollback" and req.partition_key == "round-000000"
    failing = {**res, "settings": make_resources(
        {**TINY, "home": str(tmp_path / "home"), "promotion": "review", "target": "command",
         "target_command": "sh -c 'echo no capacity >&2; exit 1'"}, tracking_uri=mlflow_server,
        s3=s3_stores(s3_endpoint, bucket))["settings"]}
    out = run(req, failing)
    assert not out.success and "no capacity" in out.get_step_failure_events()[0].event_specific_data.error.to_string()
    assert svc.ledger.live().policy_version == "round-000002" and lin.alias_version(CHAMPION) == pending
    assert "no pending decision" in tick().skip_message  # nothing asked for any more
    lin.promote("1")  # the reviewer tries again: a new request, not the failed run's key
    again = tick().run_requests[0]
    assert again.run_key != req.run_key and run(again, res).success
    assert (svc.ledger.live().policy_version, svc.ledger.live().kind) == ("round-000000", "rollback")


def test_round_states_and_tag_consistency():
    d = {"passed": True, "deployed": False, "review": "pending"}
    assert round_state.round_state(None) == round_state.RUNNING
    assert round_state.round_state({"passed": False}) == round_state.GATE_FAILED
    assert round_state.round_state(d) == round_state.PENDING_REVIEW
    assert round_state.round_state({**d, "review": "rejected"}) == round_state.REJECTED
    assert round_state.round_state({**d, "review": "none"}) == round_state.AWAITING_DEPLOY
    assert round_state.round_state({**d, "deployed": True, "review": "approved"}) == round_state.DEPLOYED
    assert round_state.round_state({**d, "review": "approved", "deploy_failed": "probe"}) == round_state.DEPLOY_FAILED
    for state in (round_state.RUNNING, round_state.GATE_FAILED, round_state.PENDING_REVIEW, round_state.REJECTED,
                  round_state.AWAITING_DEPLOY, round_state.DEPLOYED, round_state.DEPLOY_FAILED):
        dec = {**d, "review": {round_state.REJECTED: "rejected", round_state.DEPLOYED: "approved",
                               round_state.AWAITING_DEPLOY: "none"}.get(state, "pending")}
        tags = review.state_tags(state, dec)
        assert list(tags) == ["gate", "review", "deployed"] and not review.tag_problems(tags), (state, tags)
        # every prefix of the write order from the registered state is consistent too
        cur = review.state_tags(round_state.RUNNING)
        for k, v in tags.items():
            cur = {**cur, k: v}
            assert not review.tag_problems(cur), (state, cur)
    assert review.tag_problems({"gate": "failed", "review": "approved", "deployed": "false"})
    assert review.tag_problems({"gate": "passed", "review": "pending", "deployed": "true"})
    assert review.tag_problems({"gate": "pending", "review": "none", "deployed": "true"})


def test_live_reward_alert_threshold():
    from prodrl_pipelines.loop.monitoring import alert

    point = {"policy_version": "round-000003", "deployed_reward": 0.60, "tolerance": 0.05}
    assert alert({**point, "heldout_reward": 0.56})[0]  # within the tolerance
    assert alert({**point, "heldout_reward": 0.55})[0]  # exactly at it
    ok, why = alert({**point, "heldout_reward": 0.549})
    assert not ok and why.startswith("ALERT: live held-out reward 0.5490 vs 0.6000") and "drop +0.0510" in why
    assert alert({**point, "deployed_reward": float("nan"), "heldout_reward": 0.1})[0]  # nothing to compare with
