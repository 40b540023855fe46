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
from prodrl_pipelines.deploy_targets.processes import pick_port_range
from prodrl_pipelines.deploy_targets.rollout import DeployRejected, roll_out
from prodrl_pipelines.deploy_targets.server_records import pid_alive, process_start
from prodrl_pipelines.deploy_targets.servers import ProdrlServeTarget
from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from tests.helpers import until, watch_endpoint
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


def _proc(pid: int) -> tuple[int, int]:
    """A process by pid and start time: a pid the kernel hands out again names another process."""
    return pid, process_start(pid) or -1


def _leftovers(cluster, prefix: str, pids: set[tuple[int, int]]) -> list[str]:
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
    return actors + pgs + [f"pid {p}" for p, t in sorted(pids) if pid_alive(p, t)]


def _actor_pid(cluster, name: str) -> int:
    from ray.util.state import list_actors

    [a] = list_actors(address=cluster.cluster_address, filters=[("name", "=", name), ("state", "=", "ALIVE")],
                      raise_on_missing_output=False)
    return int(a.pid)




def _serving(target, slot: int, version: str):
    """The slot's current server when it is alive, serves ``version`` and the endpoint file lists its URL."""
    from prodrl_pipelines.deploy_targets.fleet_keeper import serves

    rec = target.current(slot)
    listed = [r["url"] for r in endpoint_file(target.home).read().replica_list()]
    return rec if rec is not None and rec.url in listed and serves(rec.url, version) else None


@pytest.mark.long(seconds=120)
def test_a_ray_fleet_through_updates_canaries_and_the_failures_a_cluster_has(ray_driver, ray_cluster, tiny_exports,
                                                                             tmp_path):
    """Three replicas on two nodes under steady traffic through the recorder, one scenario: rolling
    update v1 -> v2; a canary that passes (its slice answered by it) and one that fails its probe; a
    probe failure in wave 2 of 3 (wave 1 restored); a server SIGKILLed, an actor's worker SIGKILLed
    with its port taken, the worker node removed then a new one added. Every replica comes back at the
    live version; 0 failed calls; every row tagged with a version that served; nothing left running."""
    import httpx
    import ray

    from prodrl_pipelines.deploy_targets.fleet_keeper import keeper_stats
    from prodrl_pipelines.deploy_targets.rollout import start_canary
    from prodrl_pipelines.recorder.balancer import canary_share

    s = _settings(tmp_path, probe_mean_bound=1e-4)
    bf16, w4a4 = tiny_exports["bf16"], tiny_exports["nvfp4-w4a4"]

    class Broken(ProdrlServeTarget):  # serves W4A4 weights under the bf16 name where the test says
        def command(self, export_dir, port, policy_version):
            broken = policy_version == "c2" or (policy_version == "v3" and port in self._ports(1))
            return super().command(w4a4 if broken else export_dir, port, policy_version)

    target = Broken(s, s.home_path, cluster=ray_driver)
    prefix = target.ray_placement().prefix
    seen_pids: set[tuple[int, int]] = set()
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                            store_dir=str(tmp_path / "store"), token="t", top_logprobs=4))
    extra, traffic = 0, None
    try:
        first = roll_out(s, Broken(s.model_copy(update={"deploy": s.deploy.model_copy(
            update={"max_unavailable": 3})}), s.home_path, cluster=ray_driver), bf16, "v1", PROMPTS)
        assert first.waves == 1
        v1 = target.currents()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2 and {r.node for r in v1} == nodes  # replicas on both nodes
        for r in v1:
            assert r.actor.startswith(prefix) and r.url == f"http://{r.host}:{r.port}" and r.host == "127.0.0.1"
        seen_pids |= {_proc(r.pid) for r in v1}
        assert len(_leftovers(ray_driver, prefix, seen_pids)) == 3 * 3 + 1  # 3 actors, groups, pids; the keeper

        with BackgroundServer(app) as rec:
            traffic = Traffic(rec.url, workers=2, pause_s=0.1)
            time.sleep(1.0)

            # 1. the rolling update, wave by wave, each replica's version in the endpoint file
            with watch_endpoint(s.home_path) as seen:
                ro = roll_out(s, ProdrlServeTarget(s, s.home_path, cluster=ray_driver), bf16, "v2", PROMPTS)
            assert ro.waves == 3 and ro.probe.passed
            assert {tuple(v) for v in seen} <= {("v1",) * 3, ("v2", "v1", "v1"), ("v2", "v2", "v1"), ("v2",) * 3}
            v2 = target.currents()
            assert [r.policy_version for r in v2] == ["v2"] * 3 and {r.node for r in v2} == nodes
            assert not {r.actor for r in v1} & {r.actor for r in v2}
            assert not [r for r in v1 if ray_alive(r)], "an old replica's actor outlived the update"
            seen_pids |= {_proc(r.pid) for r in v2}

            # 2. a canary placed like a replica: probed, then its slice answered by it, then stopped
            start_canary(s, target, bf16, "c1", PROMPTS, fraction=0.3)
            can = target.canary()
            assert can is not None and can.actor.startswith(prefix) and can.policy_version == "c1"
            seen_pids.add(_proc(can.pid))
            ids = [t for t in (f"slice-{i}" for i in range(200)) if canary_share(t) < 0.3][:3]
            with httpx.Client(base_url=rec.url, headers={"Authorization": "Bearer t"}, timeout=60) as h:
                for t in ids:
                    r = h.post("/v1/completions", json={"model": "any", "prompt": PROMPTS[0], "max_tokens": 4},
                               headers={"X-Trajectory-Id": t})
                    assert r.status_code == 200, r.text
            extra += len(ids)
            assert "stopped the canary (c1)" in target.stop_canary()
            assert target.canary() is None and not ray_alive(can)

            # 3. a canary whose weights are not the export's: refused by its probe, the fleet untouched
            with pytest.raises(DeployRejected) as err:
                start_canary(s, target, bf16, "c2", PROMPTS, fraction=0.3)
            assert "canary parity probe failed" in err.value.reason, err.value.reason
            assert target.canary() is None and endpoint_file(s.home_path).read().canary is None
            assert [r.actor for r in target.currents()] == [r.actor for r in v2]

            # 4. replica 1's new server broken: wave 1 commits v3, wave 2's probe fails, replica 0 is back at v2
            with pytest.raises(DeployRejected) as err:
                roll_out(s, target, bf16, "v3", PROMPTS)
            e = err.value
            assert "parity probe failed" in e.reason and "wave 2/3" in e.reason, e.reason
            assert "restored replica 0: v2" in e.rollback, e.rollback
            now = target.currents()
            assert [r.policy_version for r in now] == ["v2"] * 3
            assert now[0].pid != v2[0].pid and [r.pid for r in now[1:]] == [r.pid for r in v2[1:]]  # a new server on 0
            seen_pids.add(_proc(now[0].pid))

            # 5. replica 0's server SIGKILLed: its actor brings it back at v2, same URL, new pid
            os.kill(now[0].pid, 9)
            back = until("replica 0 back", lambda: (r := _serving(target, 0, "v2")) and r.pid != now[0].pid and r)
            assert back.actor == now[0].actor and back.url == now[0].url
            seen_pids.add(_proc(back.pid))

            # 6. replica 1's actor killed with its port taken meanwhile: a restarted actor, another port
            old1 = target.current(1)
            old1_proc = _proc(old1.pid)
            os.kill(_actor_pid(ray_driver, old1.actor), 9)
            import socket

            squat = socket.socket()
            squat.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            until("the old port freed", lambda: _bind(squat, old1.port), timeout_s=120, every_s=0.02)
            squat.listen()
            try:
                moved = until("replica 1 moved", lambda: (r := _serving(target, 1, "v2")) and r.port != old1.port
                               and r)
            finally:
                squat.close()
            assert moved.actor == old1.actor and not pid_alive(*old1_proc) and keeper_stats(target)["moves"] >= 1
            seen_pids.add(_proc(moved.pid))

            # 7. the worker node goes away: its replicas come back at v2 (the last on a new node)
            gone = ray_cluster.remove_node()
            added = ray_cluster.add_node()
            final = [until(f"replica {i} back after the node died", lambda i=i: _serving(target, i, "v2"),
                            timeout_s=240) for i in range(3)]
            assert gone not in {r.node for r in final} and {r.node for r in final} <= nodes - {gone} | {added}
            seen_pids |= {_proc(r.pid) for r in final}
            time.sleep(1.0)
            sent = traffic.finish()
            stats = httpx.get(f"{rec.url}/stats", headers={"Authorization": "Bearer t"}).json()
        assert not traffic.failures, traffic.failures[:5]
        assert app.state.recorder.ingestor.flush(30)
        rows = app.state.recorder.store.read_calls().to_pylist()
        assert len(rows) == sent + extra and sent > 50
        versions = {r["policy_version"] for r in rows}
        assert {"v1", "v2", "c1"} <= versions <= {"v1", "v2", "v3", "c1"}, versions
        counted = {k.rsplit(".", 1)[1]: v for k, v in stats["counters"].items() if k.startswith("recorded_calls.version.")}
        assert counted == {v: sum(r["policy_version"] == v for r in rows) for v in versions}
        print(f"Ray fleet scenario: {sent} calls, {len(final)} replicas back after node {gone[:8]} died")
    finally:
        if traffic is not None:
            traffic.finish()  # its threads would keep the process alive after a failure
        target.stop()
    assert target.currents() == [None] * 3
    assert not _leftovers(ray_driver, prefix, seen_pids), _leftovers(ray_driver, prefix, seen_pids)


def _bind(sock, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


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
    assert target.current() is None and target.slots.read(0, "pending") is None
    prefix = target.ray_placement().prefix
    assert not _leftovers(ray_driver, prefix, set())

    s = _settings(tmp_path, replicas=1, health_timeout_s=60)
    target = make_target(s, ray_driver)
    missing = tmp_path / "no-such-export"
    with pytest.raises(DeployRejected) as err:  # the server exits on its node: its log comes back from there
        roll_out(s, target, missing, "v1", PROMPTS)
    assert "exited before it was healthy" in err.value.reason and str(missing) in err.value.reason, err.value.reason
    assert target.current() is None and target.slots.read(0, "pending") is None
    assert not _leftovers(ray_driver, prefix, set())


@pytest.mark.long(seconds=15)
def test_replica_spread_places_one_replica_per_node_and_refuses_a_third(ray_driver, tiny_exports, tmp_path):
    """Two nodes, three replicas, ``replica_spread``: the first two new servers land on distinct nodes,
    the third fits no node without one and the deploy fails naming the setting; nothing is left."""
    import threading

    # the placement timeout: the third group can never be placed; the first two are placed at once on
    # any machine, loaded or not (10 s is far above what the head takes)
    s = _settings(tmp_path, max_unavailable=3, replica_spread=True, health_timeout_s=10)
    target = make_target(s, ray_driver)
    nodes: dict[int, str] = {}
    stop = threading.Event()

    def watch():  # the pending servers' nodes while the wave starts
        while not stop.is_set():
            for i in range(3):
                raw = target.slots.read(i, "pending")
                if raw:
                    nodes[i] = raw["node"]
            time.sleep(0.02)

    w = threading.Thread(target=watch)
    w.start()
    try:
        with pytest.raises(DeployRejected) as err:
            roll_out(s, target, tiny_exports["bf16"], "v1", PROMPTS)
    finally:
        stop.set()
        w.join()
    assert ("replica 2: no node of the Ray cluster offered {'CPU': 1.0} on a node other than the 2 holding the "
            "other replicas (replica_spread) within 10s") in err.value.reason, err.value.reason
    assert set(nodes) == {0, 1} and nodes[0] != nodes[1]
    assert target.currents() == [None] * 3
    assert not _leftovers(ray_driver, target.ray_placement().prefix, set())


@pytest.mark.long(seconds=20)
def test_a_node_without_the_export_fetches_it_from_the_s3_store(ray_driver, ray_cluster, tiny_exports, s3_endpoint,
                                                                bucket, tmp_path, monkeypatch):
    """The deploy environment's store is S3 (a real endpoint): the export is published as a round does,
    and the deploying host's copy is gone once the command line is built, so the node must fetch it
    into its cache (verified) and serve that; the record names the cached path."""
    import json
    import shutil

    import httpx

    from prodrl_pipelines.config import environment
    from prodrl_pipelines.deploy_targets import ray_placement
    from prodrl_pipelines.deploy_targets.node_exports import cache_dir, export_source
    from prodrl_pipelines.deploy_targets.ray_placement import refresh
    from prodrl_pipelines.loop.services import build_services, publish_export
    from prodrl_pipelines.storage.locations import StoreLocation

    s = _settings(tmp_path, replicas=1, probe_prompts=0)  # the probe reads the export here: gone on purpose
    export = s.exports_root / "round-000001"
    shutil.copytree(tiny_exports["bf16"], export)
    loc = StoreLocation(s3_bucket=bucket, s3_prefix="prod", s3_endpoint_url=s3_endpoint)
    publish_export(build_services(s, loc), "round-000001", export)
    for k, v in {"bucket": bucket, "prefix": "prod", "endpoint_url": s3_endpoint}.items():
        monkeypatch.setenv(environment.s3_var(k), v)
    cache = tmp_path / "node-cache"
    creds = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    cluster = ray_driver.model_copy(update={"cluster_runtime_env": json.dumps(
        {"env_vars": {**creds, "PRODRL_NODE_CACHE": str(cache)}})})

    class HostLosesItsCopy(ProdrlServeTarget):
        def command(self, export_dir, port, policy_version):
            cmd = super().command(export_dir, port, policy_version)
            shutil.rmtree(export_dir, ignore_errors=True)
            return cmd

    target = HostLosesItsCopy(s, s.home_path, cluster=cluster)
    try:
        roll_out(s, target, export, "v1", PROMPTS)
        rec = target.current()
        assert rec is not None and not export.exists()
        assert ray_placement.kv_get(f"rec/{rec.actor}")["export"] == str(
            cache_dir(export_source(s, export), cache) / "round-000001")  # the node's copy
        assert refresh({"actor": rec.actor, "ray_address": rec.ray_address})["url"] == rec.url
        r = httpx.post(f"{rec.url}/v1/completions", json={"model": "v1", "prompt": PROMPTS[0], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "v1"
    finally:
        target.stop()


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
