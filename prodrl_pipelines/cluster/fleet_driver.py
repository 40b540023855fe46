"""What the deploy step does on Dagster's host (no raylet), run there by tests/test_hosts.py and
bench/hosts.py on the simulated hosts (``cluster/hosts.py``):

    python -m prodrl_pipelines.cluster.fleet_driver deploy HOME EXPORT VERSION [DEPLOY_JSON]  # publish EXPORT to S3, roll it out
    python -m prodrl_pipelines.cluster.fleet_driver stop HOME                    # stop the fleet, list what is left
    python -m prodrl_pipelines.cluster.fleet_driver endpoint WHERE VERSION URLS  # write an endpoint record listing URLS
    python -m prodrl_pipelines.cluster.fleet_driver round-report HOME ROUND      # where a round's steps ran, what is live

The store (``PRODRL_S3_*``), the cluster (``PRODRL_SETTINGS_JSON``: cluster ray, the head's dashboard)
and the deployment's key (``PRODRL_DEPLOY_API_KEY``) come from the environment, as in a run worker.
The last line is JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42, 9, 9]]


def settings(home: str, overrides: str = "{}"):
    from prodrl_pipelines.config.settings import Settings

    return Settings(home=home, deploy={
        "target": "prodrl-serve", "target_port": 18000, "replicas": 2, "max_unavailable": 1, "probe_prompts": 2,
        "max_tokens": 4, "export_scheme": "bf16", "replica_placement": "ray", "replica_spread": True,
        **json.loads(overrides)})


def deploy(home: str, export: str, version: str, overrides: str = "{}") -> dict:
    """Publish and roll out; a rejected roll-out is reported (its reason and what the rollback did)
    beside what the endpoint record lists afterwards, not raised."""
    import boto3

    from prodrl_pipelines.config import environment
    from prodrl_pipelines.deploy_targets import endpoint_file, make_target
    from prodrl_pipelines.deploy_targets.ray_placement import local_raylet
    from prodrl_pipelines.deploy_targets.rollout import DeployRejected, roll_out
    from prodrl_pipelines.loop.services import build_services, publish_export
    from prodrl_pipelines.storage.locations import StoreLocation

    s = settings(home, overrides)
    loc = StoreLocation(**environment.read_store())
    boto3.client("s3", endpoint_url=loc.s3_endpoint_url, region_name="us-east-1").create_bucket(Bucket=loc.s3_bucket)
    publish_export(build_services(s, loc), Path(export).name, Path(export))
    target = make_target(s)
    try:
        ro = roll_out(s, target, Path(export), version, PROMPTS, api_key=environment.deploy_api_key())
        out = {"waves": ro.waves, "seconds": ro.seconds}
    except DeployRejected as e:
        out = {"rejected": e.reason, "rollback": e.rollback}
    ep = endpoint_file(s.home_path, s.deploy).read()
    return {**out, "replicas": ep.replica_list(), "raylet_here": local_raylet("x:6379"),
            "slots": [{"version": r["policy_version"], "url": r["url"]} if r else None  # as recorded: no cluster call
                      for r in (target.slots.read(i, "current") for i in range(target.replicas))]}


def stop(home: str) -> dict:
    import ray

    from prodrl_pipelines.deploy_targets import make_target
    from prodrl_pipelines.deploy_targets.ray_placement import NAMESPACE
    from prodrl_pipelines.deploy_targets.servers import ManagedServerTarget

    target = make_target(settings(home))
    assert isinstance(target, ManagedServerTarget)
    target.stop()
    from ray.util.placement_group import placement_group_table

    target.ray_placement().connect()
    pgs = [p["name"] for p in placement_group_table().values() if p["state"] != "REMOVED"]
    actors = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["namespace"] == NAMESPACE]
    return {"placement_groups": pgs, "actors": actors}


def endpoint(where: str, version: str, urls: str) -> dict:
    """Write the endpoint record at ``where`` (a file or ``URL#NAME``): the servers at ``urls`` (a JSON
    list, each serving the model name ``v1``) filed under ``version``, as a deploy's commit writes it."""
    from prodrl_pipelines.deploy_targets.base import Endpoint
    from prodrl_pipelines.deploy_targets.endpoint_store import open_endpoint

    listed = json.loads(urls)
    open_endpoint(where).write(Endpoint(listed[0], "v1", version, replicas=[
        {"url": u, "served_model_name": "v1", "policy_version": version} for u in listed]))
    return {"where": where, "version": version, "replicas": len(listed)}


def round_report(home: str, rkey: str) -> dict:
    """What a round run from this host did (read back from the store, the ledger, the Ray dashboard
    and the endpoint record): the hosts its training ranks ran on, its Ray jobs, its decision, the
    exports published to the store, the live version and the replicas serving it."""
    import httpx

    from prodrl_pipelines.deploy_targets import endpoint_file
    from prodrl_pipelines.deploy_targets.ray_placement import local_raylet
    from prodrl_pipelines.resources.settings import open_services, resources_from_env
    from prodrl_pipelines.storage import documents, keys

    res = resources_from_env(json.loads((Path(home) / "settings.json").read_text()))  # the store the round used
    svc, cluster = open_services(res["settings"], res["store"]), res["settings"].cluster_config()
    s = svc.settings
    ranks = [documents.get_json(svc.blobs, keys.train_worker(rkey, r)) for r in range(cluster.cluster_workers)]
    jobs = httpx.get(f"{cluster.cluster_address}/api/jobs/", timeout=30).json()
    decision = svc.ledger.decision(rkey) or {}
    summary = svc.ledger.round_summary(rkey)
    return {"train_hosts": sorted(w["host"] for w in ranks), "train_nodes": len({w["node"] for w in ranks}),
            "decision": {k: decision.get(k) for k in ("passed", "deployed", "reasons", "warnings")},
            "heldout_reward": summary.get("heldout_reward"), "num_trajectories": summary.get("num_trajectories"),
            "live": svc.ledger.live().policy_version,
            "exports": [] if svc.exports_store is None else sorted(svc.exports_store.names()),
            "jobs": sorted(f"{(j.get('submission_id') or '').rsplit('-', 1)[0]}:{j['status']}" for j in jobs),
            "replicas": [r["url"] for r in endpoint_file(s.home_path, s.deploy).read().replica_list()],
            "raylet_here": local_raylet("x:6379")}


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    out = {"deploy": deploy, "stop": stop, "endpoint": endpoint, "round-report": round_report}[cmd](*args)
    print(json.dumps(out), flush=True)
