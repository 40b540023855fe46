"""Two rounds through Dagster on the PostgreSQL instance: asset chain, sensor, gate, MLflow aliases."""

import json

import numpy as np
import pytest
from dagster import AssetKey, build_sensor_context, materialize
from safetensors.torch import load_file, save_file

from prodrl_pipelines.assets.gate import deployment_gate
from prodrl_pipelines.assets.round import (
    deployment, exported_policy, heldout_eval, recorded_trajectories, trained_checkpoint, training_batch,
)
from prodrl_pipelines.definitions import build_definitions
from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import make_resources, open_services
from prodrl_pipelines.sensors import data_volume_sensor
from prodrl_pipelines.loop.lineage import CHALLENGER, CHAMPION

TINY = {"lab_size": "tiny", "lab_sft_steps": 30, "steps_per_round": 2, "batch_size": 4,
        "heldout_size": 12, "max_tokens": 6, "gate_tolerance": 0.5}
ROUND_ASSETS = [recorded_trajectories, training_batch, trained_checkpoint, exported_policy, heldout_eval, deployment]


def tick(instance, defs, res):
    return data_volume_sensor(build_sensor_context(instance=instance, definitions=defs, resources=res))


def request_round(instance, defs, res):
    result = tick(instance, defs, res)
    assert result.run_requests, result
    for req in result.dynamic_partitions_requests:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return result.run_requests[0]


@pytest.mark.long(seconds=75)
def test_two_rounds_on_postgres(tmp_path, pg_instance):
    instance = pg_instance
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    res = make_resources({**TINY, "home": str(tmp_path / "home")})
    defs = build_definitions(res)
    svc = open_services(res["settings"], res["store"], res["mlflow"])

    # Before bootstrap the sensor explains why it waits.
    assert "no live deployment" in tick(instance, defs, res).skip_message

    assert defs.resolve_job_def("bootstrap").execute_in_process(instance=instance).success
    lineage = res["mlflow"].lineage(svc.settings)
    assert lineage.alias_version(CHAMPION) == "1"

    # Not enough data yet: skip with the numbers.
    msg = tick(instance, defs, res).skip_message
    assert "0/8 eligible" in msg

    simulate_traffic(svc, 8)
    req = request_round(instance, defs, res)
    assert req.partition_key == "round-000001" and req.run_key == "round-000001"
    assert instance.get_dynamic_partitions("rounds") == ["round-000001"]

    # --- round 1: the whole chain, gate passes, deployed
    out = defs.resolve_job_def("prod_rl_round").execute_in_process(instance=instance, partition_key="round-000001",
                                                                tags=req.tags)
    assert out.success
    mats = {e.asset_key.path[-1] for e in out.get_asset_materialization_events()
            for e in [e.event_specific_data.materialization]}
    assert mats == {"scored_rewards", "recorded_trajectories", "training_batch", "trained_checkpoint",
                    "exported_policy", "heldout_eval", "deployment"}
    checks = {e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data.passed
              for e in out.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert checks == {"deployment_gate": True, **{f"monitor_{n}": True for n in
                                                   ("format_errors", "length_drift", "refusal_rate", "kl", "slices")}}
    rec = instance.get_latest_materialization_event(AssetKey("recorded_trajectories")).asset_materialization
    assert rec.partition == "round-000001" and rec.metadata["num_trajectories"].value == 8
    assert svc.ledger.live().policy_version == "round-000001"
    assert lineage.alias_version(CHAMPION) == lineage.alias_version(CHALLENGER) == "2"
    summary = svc.ledger.round_summary("round-000001")
    assert summary["gate_passed"] and summary["deployed"] and np.isfinite(summary["mismatch_abs_logp"])
    steps = json.loads(svc.blobs.get_bytes("rounds/round-000001/train_steps.json"))
    assert len(steps) == 2
    mlrun = lineage.client.get_run(summary["mlflow_run_id"])
    # per-step metrics (a step with all-zero advantages is skipped and logged as such)
    assert {"skipped", "adv_mean", "heldout_reward"} <= set(mlrun.data.metrics)
    arts = {a.path for a in lineage.client.list_artifacts(mlrun.info.run_id, "plots")}
    assert {"plots/reward_curve.png", "plots/mismatch.png"} <= arts

    # Idempotent sensor: round 1 done but no new data from the new live policy.
    assert "0/8 eligible" in tick(instance, defs, res).skip_message

    # --- round 2: a deliberately broken candidate (NaN weights): the export refuses it, naming the tensor
    simulate_traffic(svc, 8)
    req = request_round(instance, defs, res)
    assert req.partition_key == "round-000002"
    first = materialize(ROUND_ASSETS[:3], instance=instance, partition_key="round-000002", resources=res)
    assert first.success
    ckpt = svc.settings.checkpoints_root / "round-000002" / "model.safetensors"
    sd = load_file(ckpt)
    name = next(k for k in sd if "mlp" in k)
    sd[name][0, 0] = float("nan")
    save_file(sd, ckpt, metadata={"format": "pt"})
    second = materialize([*ROUND_ASSETS, deployment_gate], selection=ROUND_ASSETS[3:], instance=instance,
                         partition_key="round-000002", resources=res, raise_on_error=False)
    assert not second.success
    failures = second.get_step_failure_events()
    assert [e.step_key for e in failures] == ["exported_policy"]
    err = failures[0].event_specific_data.error
    assert "non-finite weights" in err.to_string() and name in err.to_string()
    assert not (svc.settings.exports_root / "round-000002").exists()  # nothing half-written
    assert "deployment" not in {e.event_specific_data.materialization.asset_key.path[-1]
                                for e in second.get_asset_materialization_events()}
    # Live deployment and champion untouched; no candidate registered; the round is decided (rejected).
    assert svc.ledger.live().policy_version == "round-000001"
    assert lineage.alias_version(CHAMPION) == lineage.alias_version(CHALLENGER) == "2"
    decision = svc.ledger.decision("round-000002")
    assert decision["deployed"] is False and not decision["passed"] and name in decision["reasons"][0]

    # Scheduled evaluation of the live deployment: one point of the time series, in Dagster and MLflow.
    # Each point is a fresh sample (seed = eval_seed + 1 + index) of what serves, with its alert check.
    for index in (0, 1):
        ev = defs.resolve_job_def("live_eval").execute_in_process(instance=instance)
        point = ev.asset_materializations_for_node("live_heldout_eval")[0].metadata
        assert (point["policy_version"].value, point["index"].value, point["engine"].value) == ("round-000001", index, "local")
        assert point["seed"].value == svc.settings.eval.eval_seed + 1 + index
        assert point["deployed_reward"].value == pytest.approx(summary["heldout_reward"])
        check = ev.get_asset_check_evaluations()[0]
        assert check.check_name == "live_reward_alert" and check.passed == (
            point["heldout_reward"].value >= summary["heldout_reward"] - TINY["gate_tolerance"])
    mon = lineage.client.search_runs([lineage.experiment_id], "tags.`prodrl.round` = 'live-monitoring'")[0]
    assert mon.info.status == "FINISHED"
    assert [m.step for m in lineage.client.get_metric_history(mon.info.run_id, "live_heldout_reward")] == [0, 1]

    # Round 3 trains from the live checkpoint (round 1), not from the rejected one.
    simulate_traffic(svc, 8)
    req = request_round(instance, defs, res)
    assert req.partition_key == "round-000003"
    materialize(ROUND_ASSETS[:3], instance=instance, partition_key="round-000003", resources=res)
    assert svc.ledger.round_summary("round-000003")["trained_from"] == "round-000001"

    # ... and its deploy fails (the deploy target's command exits 1): the asset fails with the
    # command's stderr, the live version and champion stay, the model version carries the reason.
    failing = make_resources({**TINY, "home": str(tmp_path / "home"), "target": "command",
                              "target_command": "sh -c 'echo cluster unreachable >&2; exit 1'"})
    third = materialize([*ROUND_ASSETS, deployment_gate], selection=ROUND_ASSETS[3:] + [deployment_gate],
                        instance=instance, partition_key="round-000003", resources=failing, raise_on_error=False)
    assert [e.step_key for e in third.get_step_failure_events()] == ["deployment"]
    assert "cluster unreachable" in third.get_step_failure_events()[0].event_specific_data.error.to_string()
    assert svc.ledger.live().policy_version == "round-000001"
    assert lineage.alias_version(CHAMPION) == "2"
    cand = lineage.alias_version(CHALLENGER)
    assert cand != "2" and "cluster unreachable" in lineage.client.get_model_version(lineage.model_name, cand).tags["deploy_failed"]
    decision = svc.ledger.decision("round-000003")
    assert decision["passed"] and decision["deployed"] is False and "cluster unreachable" in decision["deploy_failed"]


def test_bad_settings_fail_before_work(tmp_path):
    with pytest.raises(ValueError, match="correction: unknown correction 'magic'"):
        make_resources({"home": str(tmp_path), "correction": "magic"})
    with pytest.raises(ValueError, match="batch_size: Input should be greater than or equal to 2"):
        make_resources({"home": str(tmp_path), "batch_size": 0})
    with pytest.raises(ValueError, match="unknown setting 'batchsize'"):
        make_resources({"home": str(tmp_path), "batchsize": 4})


def test_round_without_enough_data_names_the_setting(tmp_path, pg_instance):
    res = make_resources({**TINY, "home": str(tmp_path / "home")})
    defs = build_definitions(res)
    assert defs.resolve_job_def("bootstrap").execute_in_process(instance=pg_instance).success
    svc = open_services(res["settings"], res["store"])
    simulate_traffic(svc, 3)
    pg_instance.add_dynamic_partitions("rounds", ["round-000001"])
    out = materialize([recorded_trajectories], instance=pg_instance, partition_key="round-000001",
                      resources=res, raise_on_error=False)
    assert not out.success
    err = out.get_step_failure_events()[0].event_specific_data.error
    assert "steps_per_round" in str(err.cause or err.message) or "steps_per_round" in err.to_string()


def test_ref_is_without_deployed_export_fails_before_data(tmp_path):
    from prodrl_pipelines.loop.ledger import LiveDeployment
    from prodrl_pipelines.loop.services import RoundError, check_recipe_fits_deployment

    res = make_resources({"home": str(tmp_path), "correction": "ref_is"})
    svc = open_services(res["settings"], res["store"])
    live = LiveDeployment("round-000000", str(tmp_path / "ckpt"), str(tmp_path / "no-export"))
    with pytest.raises(RoundError, match="correction='ref_is' needs the deployed export"):
        check_recipe_fits_deployment(svc, live)


def test_one_round_at_a_time(tmp_path, pg_instance):
    from dagster import DagsterRun, DagsterRunStatus
    from dagster._core.utils import make_new_run_id

    from prodrl_pipelines.sensors import round_job

    # the instance queues round runs behind a tag limit of 1 (dagster.yaml), and round runs carry the tag
    limits = pg_instance.run_coordinator.get_run_queue_config().tag_concurrency_limits
    assert {"key": "prodrl/round", "limit": 1} in limits
    assert round_job.tags["prodrl/round"] == "train"

    res = make_resources({**TINY, "home": str(tmp_path / "home")})
    defs = build_definitions(res)
    assert defs.resolve_job_def("bootstrap").execute_in_process(instance=pg_instance).success
    simulate_traffic(open_services(res["settings"], res["store"]), 8)
    run = DagsterRun(job_name="prod_rl_round", run_id=make_new_run_id(), status=DagsterRunStatus.STARTED,
                     tags={"prodrl/round": "train"})
    pg_instance.add_run(run)
    # enough data, but a round is running: the sensor waits instead of starting a second one
    assert "in flight" in tick(pg_instance, defs, res).skip_message
    pg_instance.report_run_canceled(run)  # a cancelled run frees the slot
    assert tick(pg_instance, defs, res).run_requests[0].partition_key == "round-000001"
