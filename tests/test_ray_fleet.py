"""A fleet of ``prodrl serve`` replicas placed on the session's two-node Ray cluster
(``replica_placement: ray``): each replica's server is owned by a detached Ray actor in a placement
group of its own; a rolling update v1 -> v2 under steady traffic through the recorder fails no call
and tags every call with its version; nothing is left running afterwards. Failure paths: a
replica that fits no node, a server that exits on its node, settings that name no Ray cluster."""

from __future__ import annotations

import os
import time

import pytest

from prodrl_pipelines.cluster.config import cluster_settings
from prodrl_pipelines.config.settings import Settings, settings_from_flat
from prodrl_pipelines.deploy_targets import endpoint_file, make_target
from prodrl_pipelines.deploy_targets.base import read_json
from prodrl_pipelines.deploy_targets.processes import pick_port_range
from prodrl_pipelines.deploy_targets.rollout import DeployRejected, roll_out
from prodrl_pipelines.deploy_targets.server_records import pid_alive
from prodrl_pipelines.deploy_targets.servers import ProdrlServeTarget
from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from tests.helpers import watch_endpoint
from tests.test_fleet import PROMPTS, Traffic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ray_driver(ray_cluster):
    """The cluster settings a deploy gets, and this process's Ray connection: made by the target
    itself (``RAY_ADDRESS``: the test cluster's GCS is not on the default port), closed at the end."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # 127.0.0.1 stays 127.0.0.1 when another module imported Ray first
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "127.0.0.1:" + ray_cluster.gcs_address.rpartition(":")[2]
    try:
        yield cluster_settings({"cluster": "ray", "cluster_address": ray_cluster.dashboard_url})
    finally:
        import ray

        ray.shutdown()
        if before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before


def _settings(tmp_path, replicas=3, **deploy) -> Settings:
    return Settings(home=str(tmp_path / "home"), deploy={
        "target": "prodrl-serve", "target_port": pick_port_range(2 * replicas + 2), "replicas": replicas,
        "max_unavailable": 1, "probe_prompts": 3, "max_tokens": 6, "export_scheme": "bf16",
        "replica_placement": "ray", **deploy})


def _leftovers(cluster, prefix: str, pids: set[int]) -> list[str]:
    """Our actors not dead, our placement groups not removed, our server processes still running."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.state import list_actors

    actors = [f"actor {a.name} {a.state}" for a in list_actors(address=cluster.cluster_address, limit=10000,
                                                             raise_on_missing_output=False)
              if (a.name or "").startswith(prefix) and a.state != "DEAD"]
    pgs = [f"placement group {p['name']} {p['state']}" for p in placement_group_table().values()
           if p.get("name", "").startswith(prefix) and p["state"] != "REMOVED"]
    assert ray.is_initialized()
    return actors + pgs + [f"pid {p}" for p in sorted(pids) if pid_alive(p)]


@pytest.mark.long(seconds=45)
def test_rolling_update_of_three_replicas_on_two_ray_nodes(ray_driver, tiny_exports, tmp_path):
    import ray

    s = _settings(tmp_path)
    target = make_target(s, ray_driver)
    prefix = target.ray_placement().prefix  # this deployment's actors (its state directory's digest)
    seen_pids: set[int] = set()
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                            store_dir=str(tmp_path / "store"), token="t", top_logprobs=4))
    try:
        # v1 on all three at once (nothing serves yet): 3 bundles of 1 CPU on two nodes of 2 CPUs
        first = roll_out(s, make_target(s.model_copy(update={"deploy": s.deploy.model_copy(
            update={"max_unavailable": 3})}), ray_driver), tiny_exports["bf16"], "v1", PROMPTS)
        assert first.waves == 1
        v1 = target.currents()
        assert [r.policy_version for r in v1] == ["v1"] * 3
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2 and {r.node for r in v1} == nodes  # replicas on both nodes
        for r in v1:
            assert r.actor.startswith(prefix) and r.url == f"http://{r.host}:{r.port}" and r.host == "127.0.0.1"
            assert read_json(target.slot_dir(v1.index(r)) / "current.json")["actor"] == r.actor
        assert [x["url"] for x in endpoint_file(s.home_path).read().replica_list()] == [r.url for r in v1]
        seen_pids |= {r.pid for r in v1}
        assert len(_leftovers(ray_driver, prefix, seen_pids)) == 3 * 3  # the check sees what runs: 3 actors, groups, pids

        with BackgroundServer(app) as rec:
            traffic = Traffic(rec.url)
            time.sleep(1.0)

            def servers_started():  # every server started, to check none is left
                for i in range(3):
                    for name in ("pending.json", "current.json"):
                        raw = read_json(target.slot_dir(i) / name)
                        if raw:
                            seen_pids.add(int(raw["pid"]))

            with watch_endpoint(s.home_path, also=servers_started) as seen:
                t0 = time.monotonic()
                ro = roll_out(s, ProdrlServeTarget(s, s.home_path, cluster=ray_driver), tiny_exports["bf16"], "v2",
                              PROMPTS)  # a later run
                update_s = time.monotonic() - t0
                time.sleep(1.0)
            sent = traffic.finish()
        assert not traffic.failures, traffic.failures[:5]
        assert ro.waves == 3 and ro.probe.passed
        assert all(len(v) == 3 for v in seen) and seen[-1] == ["v2"] * 3
        assert {tuple(v) for v in seen} <= {("v1",) * 3, ("v2", "v1", "v1"), ("v2", "v2", "v1"), ("v2",) * 3}
        v2 = target.currents()
        assert [r.policy_version for r in v2] == ["v2"] * 3 and {r.node for r in v2} == nodes
        assert not {r.actor for r in v1} & {r.actor for r in v2}  # blue/green: new actors, old ones gone
        assert not [r for r in v1 if ray_alive(r)], "an old replica's actor outlived the update"
        assert app.state.recorder.ingestor.flush(30)
        rows = app.state.recorder.store.read_calls().to_pylist()
        assert len(rows) == sent > 20
        assert {r["policy_version"] for r in rows} == {"v1", "v2"}
        print(f"rolling update of 3 Ray replicas: {update_s:.1f} s, {sent} calls")
    finally:
        target.stop()
    assert target.currents() == [None] * 3
    assert not _leftovers(ray_driver, prefix, seen_pids), _leftovers(ray_driver, prefix, seen_pids)


def ray_alive(rec) -> bool:
    from prodrl_pipelines.deploy_targets import ray_placement

    return ray_placement.alive(rec.actor, rec.ray_address)


@pytest.mark.long(seconds=10)
def test_a_replica_that_fits_no_node_or_exits_on_its_node_is_refused_and_removed(ray_driver, tiny_exports, tmp_path):
    s = _settings(tmp_path, replicas=1, replica_gpus=1, health_timeout_s=3)
    target = make_target(s, ray_driver)
    with pytest.raises(DeployRejected) as err:  # the CPU cluster has no GPU: the bundle never fits
        roll_out(s, target, tiny_exports["bf16"], "v1", PROMPTS)
    assert "no node of the Ray cluster offered {'CPU': 1.0, 'GPU': 1.0} within 3s" in err.value.reason, err.value.reason
    assert target.current() is None and read_json(target.slot_dir(0) / "pending.json") is None
    prefix = target.ray_placement().prefix
    assert not _leftovers(ray_driver, prefix, set())

    s = _settings(tmp_path, replicas=1, health_timeout_s=60)
    target = make_target(s, ray_driver)
    missing = tmp_path / "no-such-export"
    with pytest.raises(DeployRejected) as err:  # the server exits on its node: its log comes back from there
        roll_out(s, target, missing, "v1", PROMPTS)
    assert "exited before it was healthy" in err.value.reason and str(missing) in err.value.reason, err.value.reason
    assert target.current() is None and read_json(target.slot_dir(0) / "pending.json") is None
    assert not _leftovers(ray_driver, prefix, set())


def test_ray_placement_needs_a_ray_cluster(tmp_path):
    flat = {"home": str(tmp_path), "target": "prodrl-serve", "replica_placement": "ray"}
    with pytest.raises(ValueError, match="replica_placement: 'ray' places the replicas on a Ray cluster: set "
                                         "cluster 'ray' and cluster_address"):
        settings_from_flat(flat)
    with pytest.raises(ValueError, match="cluster_address: cluster 'ray' needs the Ray dashboard URL"):
        settings_from_flat({**flat, "cluster": "ray"})
    with pytest.raises(ValueError, match="replica_placement 'ray' needs a managed target"):
        settings_from_flat({**flat, "target": "pointer"})
    ok = settings_from_flat({**flat, "cluster": "ray", "cluster_address": "http://127.0.0.1:8265", "replica_gpus": 1})
    assert ok.deploy.replica_placement == "ray" and ok.deploy.replica_cpus == 1 and ok.deploy.replica_gpus == 1
    assert settings_from_flat({"home": str(tmp_path)}).deploy.replica_placement == "local"
