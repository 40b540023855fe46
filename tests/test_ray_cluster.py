"""The cluster setting and the local Ray cluster: two nodes on loopback, jobs submitted through the
dashboard, and a cluster that cannot be reached failing before any work starts, naming its address."""

import json
import subprocess
import sys
import time

import pytest

from prodrl_pipelines.cluster.config import ClusterSettings, cluster_settings
from prodrl_pipelines.cluster.jobs import submit_params


def test_cluster_settings_validate_early_naming_the_field():
    assert ClusterSettings().cluster == "local" and not ClusterSettings().on_ray
    with pytest.raises(ValueError, match="cluster_address: cluster 'ray' needs"):
        cluster_settings({"cluster": "ray"})
    with pytest.raises(ValueError, match="cluster_address: .*not the Ray dashboard's http"):
        cluster_settings({"cluster": "ray", "cluster_address": "127.0.0.1:6379"})
    with pytest.raises(ValueError, match="cluster_runtime_env: .*JSON object"):
        cluster_settings({"cluster_runtime_env": "[1]"})
    with pytest.raises(ValueError, match="cluster_placement"):
        cluster_settings({"cluster_placement": "everywhere"})
    s = cluster_settings({"cluster": "ray", "cluster_address": "http://127.0.0.1:8265/", "cluster_placement": "pack",
                          "learning_rate": 1e-4})  # other settings are not the cluster's business
    assert s.cluster_address == "http://127.0.0.1:8265" and s.placement_strategy == "PACK"


def test_a_job_on_a_node_without_the_drivers_local_store_stops_naming_the_fix(tmp_path):
    """A local store is the driver's directory: on a node that does not share the disk the job stops
    before any work, naming the directory, the node and S3; an S3 store or a shared disk passes."""
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.ops.ray_jobs import check_store_here

    elsewhere = tmp_path / "on-the-drivers-disk-only"
    env = environment.write(settings={"home": str(elsewhere)}, store={"root": ""})
    with pytest.raises(SystemExit, match=rf"store {elsewhere} .*not on Ray node .*PRODRL_S3_BUCKET"):
        check_store_here(env)
    with pytest.raises(SystemExit, match="store /no/such/store"):
        check_store_here(environment.write(settings={"home": str(tmp_path)}, store={"root": "/no/such/store"}))
    check_store_here(environment.write(settings={"home": str(elsewhere)}, store={"root": "", "s3_bucket": "b"}))
    elsewhere.mkdir()
    check_store_here(env)  # the disk is shared: the directory is there


def test_an_unreachable_cluster_fails_check_settings_naming_the_address(tmp_path):
    from prodrl_pipelines.resources.settings import ProdRLSettings

    f = tmp_path / "s.json"
    f.write_text(json.dumps({"home": str(tmp_path / "h"), "cluster": "ray", "cluster_address": "http://127.0.0.1:9"}))
    p = subprocess.run([sys.executable, "-m", "prodrl_pipelines.cli.main", "check-settings", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "the Ray cluster at http://127.0.0.1:9 cannot be reached" in p.stderr, p.stderr
    res = ProdRLSettings(home=str(tmp_path / "h"), cluster="ray", cluster_address="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="127.0.0.1:9 cannot be reached"):
        res.cluster_config().check_reachable()


def _succeeded(dashboard_url: str, **params) -> str:
    """Submit a job, wait (a ceiling for a loaded machine) until it ends, assert it succeeded; its logs."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(dashboard_url)
    job = client.submit_job(**params)
    deadline = time.monotonic() + 240
    while not client.get_job_status(job).is_terminal():
        assert time.monotonic() < deadline, client.get_job_logs(job)
        time.sleep(0.5)
    logs = client.get_job_logs(job)
    assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs
    return logs


def test_the_local_cluster_has_two_loopback_nodes_and_runs_a_job(ray_cluster, tmp_path):
    """Every node registers as 127.0.0.1 (no test traffic leaves loopback); a job submitted with the
    project's runtime env sees the PRODRL_* settings and both nodes."""
    cluster = ClusterSettings(cluster="ray", cluster_address=ray_cluster.dashboard_url,
                              cluster_runtime_env=json.dumps({"env_vars": {"MARK": "x"}}))
    cluster.check_reachable()
    params = submit_params(cluster, "train", [], {"home": str(tmp_path)}, {"root": ""}, "probe")
    script = ("import json, os, ray; ray.init(); "
              "print('NODES', json.dumps([[n['NodeID'], n['NodeManagerAddress'], n['Alive']] for n in ray.nodes()])); "
              "print('ENV', os.environ['MARK'], json.loads(os.environ['PRODRL_SETTINGS_JSON'])['home'])")
    params["entrypoint"] = f"{sys.executable} -c \"{script}\""
    logs = _succeeded(ray_cluster.dashboard_url, **params)
    nodes = json.loads(next(line for line in logs.splitlines() if line.startswith("NODES "))[6:])
    alive = [n for n in nodes if n[2]]
    assert len({n[0] for n in alive}) == 2 and {n[1] for n in alive} == {"127.0.0.1"}, nodes
    assert f"ENV x {tmp_path}" in logs


def test_a_job_runs_on_the_cluster_it_was_submitted_to_when_a_newer_one_runs_on_the_machine(ray_cluster, tmp_path):
    """Ray's job supervisor points a job's driver at ``<temp dir>/ray_current_cluster``: with every
    cluster in /tmp/ray that is the newest on the machine (a stack's, another test's), and a round's
    evaluation ran on a cluster that a test then stopped. Each local cluster has a temp dir of its own."""
    from prodrl_pipelines.cluster.local import LocalRayCluster

    newer = LocalRayCluster(tmp_path / "newer", nodes=1, cpus_per_node=1).start()
    try:
        assert newer.info["temp_dir"] != ray_cluster.info.get("temp_dir")
        logs = _succeeded(ray_cluster.dashboard_url, entrypoint=f"{sys.executable} -c \"import ray; ray.init(); "
                                                                "print('GCS', ray.get_runtime_context().gcs_address)\"")
        gcs = next(line for line in logs.splitlines() if line.startswith("GCS "))[4:]
        port = lambda a: a.rsplit(":", 1)[1]  # noqa: E731 - Ray reports the host as the machine's address
        assert port(gcs) == port(ray_cluster.gcs_address) != port(newer.gcs_address), (gcs, logs)
    finally:
        newer.stop()
