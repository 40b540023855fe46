"""The production-shaped loop: webserver + daemon on PostgreSQL, MLflow server (PostgreSQL + S3),
and the data-volume sensor starting two rounds by itself as traffic arrives. The traffic goes through
the recorder: lab episodes -> ``prodrl record`` (Parquet parts to the S3 store) -> ``prodrl serve``."""

import os
import time

import pytest
from dagster_graphql import DagsterGraphQLClient
from mlflow.tracking import MlflowClient

from prodrl_pipelines.devstack import Stack
from prodrl_pipelines.lab.http_traffic import LabDeployment
from prodrl_pipelines.lab.traffic import simulate_traffic
from prodrl_pipelines.resources.settings import make_resources, services

from conftest import PG_URL

TINY = {"lab_size": "tiny", "lab_sft_steps": 20, "steps_per_round": 2, "batch_size": 4, "heldout_size": 8,
        "max_tokens": 6, "gate_tolerance": 1.0}

RUNS = """query($name: String!) { runsOrError(filter: {pipelineName: $name}) {
  ... on Runs { results { runId status tags { key value } } } } }"""
MATS = """query($key: AssetKeyInput!) { assetOrError(assetKey: $key) { ... on Asset {
  assetMaterializations { partition } } } }"""


def _wait(cond, what: str, stack: Stack, timeout_s: float = 480):
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        v = cond()
        if v:
            return v
        time.sleep(1)
    logs = {n: (stack.home / "logs" / f"{n}.log").read_text(errors="replace")[-3000:] for n in ("daemon", "webserver")}
    pytest.fail(f"timed out waiting for {what}; logs: {logs}")


def test_daemon_starts_rounds_by_itself(tmp_path, pg_url, monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    home = tmp_path / "stack"
    lab_dep = LabDeployment(tmp_path / "lab_traffic")  # one served deployment across both rounds
    with Stack(home=home, pg_url=PG_URL, settings=TINY, schema=f"stack_{os.getpid()}", sensor_interval_s=2) as st:
        try:
            gql = DagsterGraphQLClient("127.0.0.1", port_number=st.ports["dagster"])

            def runs(job):
                return gql._execute(RUNS, {"name": job})["runsOrError"]["results"]

            gql.submit_job_execution("bootstrap_lab")
            _wait(lambda: any(r["status"] == "SUCCESS" for r in runs("bootstrap_lab")), "bootstrap", st)

            res = make_resources({**TINY, "home": str(home)}, tracking_uri=st.env["MLFLOW_TRACKING_URI"],
                                 s3={"s3_bucket": st.bucket, "s3_prefix": "prodrl",
                                     "s3_endpoint_url": st.env["PRODRL_S3_ENDPOINT_URL"], "s3_region": "us-east-1"})
            svc = services(res["settings"], res["store"])
            served = []
            for k in (1, 2):
                # rewarded traffic from the live policy through the recorder: the sensor does the rest
                stats = simulate_traffic(svc, 8, via="http", deployment=lab_dep)
                served.append((stats["policy_version"], lab_dep.policy_version, [p.proc.pid for p in lab_dep._procs]))
                _wait(lambda: [r for r in runs("prod_rl_round") if r["status"] == "SUCCESS"
                               and {"key": "dagster/partition", "value": f"round-{k:06d}"} in r["tags"]],
                      f"round {k}", st)
            # round 1 deployed round-000001: the deployment restarted on it and round 2's traffic came from it
            assert [v for v, _, _ in served] == ["round-000000", "round-000001"]
            assert [v for _, v, _ in served] == ["round-000000", "round-000001"]
            assert not set(served[0][2]) & set(served[1][2])  # serve + record restarted
            calls = svc.store.read_calls(columns=["policy_version"])
            assert set(calls.column("policy_version").to_pylist()) == {"round-000000", "round-000001"}
            # exactly one run per round (run_key = partition key), each through the queue
            rr = runs("prod_rl_round")
            assert len(rr) == 2 and all(r["status"] == "SUCCESS" for r in rr)
            parts = {m["partition"] for m in gql._execute(MATS, {"key": {"path": ["deployment"]}})
                     ["assetOrError"]["assetMaterializations"]}
            assert parts == {"round-000001", "round-000002"}
            assert svc.registry.decision("round-000002")["passed"]
            assert svc.registry.live().policy_version == "round-000002"

            ml = MlflowClient(st.env["MLFLOW_TRACKING_URI"])
            assert ml.get_model_version_by_alias("prodrl-policy", "champion").version == "3"
            assert ml.get_model_version_by_alias("prodrl-policy", "challenger").version == "3"
            run = ml.search_runs([ml.get_experiment_by_name("prodrl").experiment_id],
                                 filter_string="tags.`prodrl.round` = 'round-000002'")[0]
            assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # served from S3 by the server
            assert "plots/reward_curve.png" in {a.path for a in ml.list_artifacts(run.info.run_id, "plots")}
        finally:
            lab_dep.stop()
            st.stop()
            st.drop_schemas()
    assert not st.procs and not lab_dep._procs
