"""A round's training on the two-node local Ray cluster (``cluster: ray``), materialised through
Dagster: Ray Train's two workers run on different nodes and write the torchrun path's checkpoint with
the same metadata and MLflow metric keys; a worker killed mid-round fails the asset naming it
(rank, node, pid, exit) and re-materialising resumes, from the store's copy of the in-round state,
to the bitwise-identical checkpoint;
cancelling the Dagster run while training stops the Ray job."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from dagster import materialize
from safetensors.torch import load_file

from prodrl_pipelines.assets.round import recorded_trajectories, trained_checkpoint, training_batch
from prodrl_pipelines.config.environment import HOLD_RANK_AT_STEP
from prodrl_pipelines.resources.settings import make_resources
from prodrl_pipelines.storage import documents, keys
from tests.test_distributed import _round_with_data

ROUND = {"steps_per_round": 4, "batch_size": 2, "checkpoint_every": 1}  # an in-round checkpoint every step
ASSETS = [recorded_trajectories, training_batch, trained_checkpoint]


def _ray_settings(res, ray_cluster, **env) -> dict:
    return {**res["settings"].fields(), "train_processes": 1, "cluster": "ray",
            "cluster_address": ray_cluster.dashboard_url, "cluster_workers": 2, "cluster_cpus_per_worker": 1,
            "cluster_placement": "spread", "cluster_runtime_env": json.dumps({"env_vars": env}) if env else ""}


def _train(pg_instance, key, res, **kw):
    return materialize(ASSETS, selection=[trained_checkpoint], instance=pg_instance, partition_key=key,
                       resources=res, **kw)


def _workers(svc, key) -> list[dict]:
    return [documents.get_json(svc.blobs, keys.train_worker(key, r)) for r in range(2)]


def _metric_counts(res, run_id) -> dict[str, int]:
    client = res["mlflow"].lineage(res["settings"].settings()).client
    return {k: len(client.get_metric_history(run_id, k)) for k in client.get_run(run_id).data.metrics}


def _same_bits(a_dir: Path, b_dir: Path) -> None:
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), name


def _poll(what: str, fn, timeout_s: float = 180.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(every_s)


def _kill_held_rank(dashboard_url: str, svc, key: str, found: dict) -> None:
    """Once the last rank holds, SIGKILL the Ray Train worker whose pid the state API reports on that
    rank's node (whatever is found goes into ``found``; the held rank is killed even when a check fails,
    so that the step ends)."""
    from ray.util.state import list_actors

    held = None
    try:
        held = _poll("rank 1 holding", lambda: (d := _doc(svc, key, 1)) and d.get("holding_at_step") and d, 240)
        actors = list_actors(address=dashboard_url, detail=True, raise_on_missing_output=False,
                             filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
        on_node = [a for a in actors if a.node_id == held["node"]]
        assert len(on_node) == 1 and on_node[0].pid == held["pid"], (held, actors)
        found.update(pid=on_node[0].pid, node=on_node[0].node_id)
        os.kill(on_node[0].pid, signal.SIGKILL)
    except BaseException as e:  # noqa: BLE001 - reported by the test's own assertion
        found["error"] = f"{type(e).__name__}: {e}"
        if held:
            os.kill(held["pid"], signal.SIGKILL)


def _doc(svc, key: str, rank: int) -> dict | None:
    return documents.get_json(svc.blobs, keys.train_worker(key, rank)) if svc.blobs.exists(keys.train_worker(key, rank)) else None


CANCEL = r'''
import json, signal, sys
# a run worker handles SIGINT (a process started from a pytest-xdist worker inherits it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
from dagster import DagsterInstance, materialize
from prodrl_pipelines.assets.round import recorded_trajectories, trained_checkpoint, training_batch
from prodrl_pipelines.resources.settings import make_resources
res = make_resources(json.loads(sys.argv[1]))
try:
    out = materialize([recorded_trajectories, training_batch, trained_checkpoint], selection=[trained_checkpoint],
                      instance=DagsterInstance.get(), partition_key=sys.argv[2], resources=res, raise_on_error=False)
    print("SUCCESS" if out.success else "FAILED", flush=True)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
'''


@pytest.mark.long(seconds=120)
def test_a_round_trains_on_ray_as_with_torchrun_and_resumes_after_a_dead_worker(
        tmp_path, pg_instance, ray_cluster):
    res, svc, key = _round_with_data(tmp_path, pg_instance, **ROUND)
    ckpt = svc.settings.checkpoints_root / key
    in_round = svc.settings.checkpoints_root / ".in-round" / f"{key}-fsdp2"

    # the torchrun path (2 ranks): the reference checkpoint, metadata and MLflow metrics
    torchrun = _train(pg_instance, key, res)
    assert torchrun.success
    md_torchrun = torchrun.asset_materializations_for_node("trained_checkpoint")[0].metadata
    run_id = md_torchrun["mlflow_run_id"].value
    shutil.copytree(ckpt, tmp_path / "torchrun")
    metrics_before = _metric_counts(res, run_id)

    # Ray: the last rank holds after step 3; the test kills it by the pid Ray's state API reports for it
    ray_hold = make_resources(_ray_settings(res, ray_cluster, **{HOLD_RANK_AT_STEP: "3"}))
    for r in range(2):
        svc.blobs.delete(keys.train_worker(key, r), missing_ok=True)
    killer = threading.Thread(target=_kill_held_rank, args=(ray_cluster.dashboard_url, svc, key, found := {}))
    killer.start()
    killed = _train(pg_instance, key, ray_hold, raise_on_error=False)
    killer.join()
    assert not killed.success and "pid" in found, found
    failure = killed.get_step_failure_events()[0].step_failure_data
    message = failure.user_failure_data.description if failure.user_failure_data else failure.error.message
    w0, w1 = _workers(svc, key)
    assert w0["node"] != w1["node"]  # one rank per node (STRICT_SPREAD)
    assert found["node"] == w1["node"]
    assert f"training worker rank 1 (node {w1['node']}, pid {found['pid']}) died: exit" in message, message
    assert "resume" in message
    assert {p.relative_to(in_round).as_posix() for p in in_round.glob("rank*/meta-rank*.pt")} == {
        "rank0/meta-rank0.pt", "rank1/meta-rank1.pt"}  # each rank's part in a directory of its own
    shutil.rmtree(in_round)  # resumed elsewhere: the state comes back from the store

    # re-materialised on Ray: resumes from the in-round checkpoint, ends on the torchrun checkpoint bit for bit
    ray_res = make_resources(_ray_settings(res, ray_cluster))
    resumed = _train(pg_instance, key, ray_res)
    assert resumed.success
    md = resumed.asset_materializations_for_node("trained_checkpoint")[0].metadata
    assert md.keys() == md_torchrun.keys()
    assert md["resumed_from_step"].value == 2 and md["steps_taken"].value == 4 and md["train_processes"].value == 2
    assert md["global_step"].value == md_torchrun["global_step"].value
    _same_bits(tmp_path / "torchrun", ckpt)
    assert not in_round.exists() and svc.blobs.list("in-round/") == []
    w0, w1 = _workers(svc, key)
    assert w0["node"] != w1["node"] and w0["world_size"] == 2
    metrics = _metric_counts(res, run_id)
    assert metrics.keys() == metrics_before.keys()  # the same MLflow metrics, the Ray run's steps logged too
    assert metrics["loss"] == metrics_before["loss"] + 4


@pytest.mark.long(seconds=90)
def test_cancelling_the_dagster_run_while_training_stops_the_ray_job(tmp_path, pg_instance, ray_cluster):
    from ray.job_submission import JobStatus, JobSubmissionClient

    res, svc, key = _round_with_data(tmp_path, pg_instance, **ROUND)
    client = JobSubmissionClient(ray_cluster.dashboard_url)
    before = {j.submission_id for j in client.list_jobs()}
    for r in range(2):
        svc.blobs.delete(keys.train_worker(key, r), missing_ok=True)
    (tmp_path / "cancel.py").write_text(CANCEL)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "cancel.py"), json.dumps(_ray_settings(res, ray_cluster)),
                             key], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        job = _poll("the cancel run's Ray job", lambda: [j for j in client.list_jobs()
                                                         if j.submission_id not in before
                                                         and j.submission_id.startswith(f"prodrl-train-{key}")])[0]
        _poll("both ranks training", lambda: all(svc.blobs.exists(keys.train_worker(key, r)) for r in range(2)))
        assert client.get_job_status(job.submission_id) == JobStatus.RUNNING
        proc.send_signal(signal.SIGINT)  # what Dagster's run termination delivers to the step
        _poll("the Ray job stopped", lambda: client.get_job_status(job.submission_id) == JobStatus.STOPPED, 180)
    finally:
        # an in-process materialize retries the interrupted step under the round's retry policy (a new
        # job): not what is tested here, so it is stopped with its process
        proc.kill()
        log = proc.communicate(timeout=60)[0]
        for j in client.list_jobs():
            if j.submission_id not in before and not j.status.is_terminal():
                client.stop_job(j.submission_id)
    assert (f"Will terminate RayJob {job.submission_id}" in log
            or f"stopped Ray job {job.submission_id}" in log), log[-3000:]


def test_only_workers_whose_placement_group_ray_removed_are_retried():
    """Ray Train's placement-group cleaner has removed a live run's group on a loaded cluster (it took
    the controller for dead) after training finished: that round resumes under the retry policy;
    a worker killed or raising is for a person to look at first."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from prodrl_pipelines.ops.ray_train import removed_from_under

    def died(exit_type: str, detail: str) -> WorkerHealthCheckFailedError:
        return WorkerHealthCheckFailedError("A worker health check failed.", RuntimeError(
            "The actor died unexpectedly before finishing this task.\n\tpid: 29017\nThe actor is dead because its "
            f"worker process has died. Worker exit type: {exit_type} Worker exit detail: {detail} Placement group "
            "id: 9e7c, bundle index: 0"))

    class Failed(Exception):
        def __init__(self, failures):
            self.worker_failures = failures

    removed = died("INTENDED_SYSTEM_EXIT", "Destroying worker since its placement group was removed.")
    killed = died("SYSTEM_ERROR", "Worker unexpectedly exits with a connection error code 2. End of file.")
    assert removed_from_under(Failed({0: removed, 1: removed}))
    assert not removed_from_under(Failed({0: removed, 1: killed}))
    assert not removed_from_under(Failed({0: removed, 1: ValueError("placement group was removed.")}))
    assert not removed_from_under(Failed({}))
