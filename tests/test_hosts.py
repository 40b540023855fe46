"""Several hosts on this machine (``cluster/hosts.py``), and the fleet deployed the way it is deployed.

One set of five hosts for the module: h1 runs the deploy step as Dagster's run worker does, with no
raylet (KubeRay, Slurm); h2 a Ray head, h3 a Ray worker; h4 the S3 endpoint; h5 the clients. The
harness itself: a host sees only its own processes, files and name; a cut link, a partition between
two hosts and a powered-off host are faults of the network and of hosts, made by pid and by link.
Skipped with the reason where namespaces are refused (not root)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prodrl_pipelines.cluster import hosts as simhosts
from prodrl_pipelines.cluster.host_services import start_ray
from tests.helpers import until

pytestmark = [pytest.mark.skipif(bool(simhosts.unavailable()), reason=simhosts.unavailable() or "-"),
              pytest.mark.long(seconds=240)]

REPO = Path(__file__).resolve().parents[1]
PRODRL = str(Path(sys.executable).with_name("prodrl"))
KEY = "deploy-key-of-this-fleet"
# the clients of cluster.traffic: 3, each pausing 0.1 s between trajectories. Steady, with calls in
# flight at any moment, but not back to back (the bench's capacity measure): a phase that waits on
# something else (a health timeout, a database restart) does not load both cores with calls meanwhile
CLIENTS = ["3", "0.1"]


def _base_env() -> dict:
    """This process's environment without what points at this machine's own services."""
    drop = ("RAY_ADDRESS", "PRODRL_SETTINGS_JSON", "PRODRL_TEST_RAY_ROOT", "http_proxy", "https_proxy",
            "HTTP_PROXY", "HTTPS_PROXY", "DAGSTER_HOME", "MLFLOW_TRACKING_URI",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")  # the local test cluster's loopback-only switch
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PRODRL_S3_")}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO)}




def _http_code(host: simhosts.Host, url: str, *args: str, timeout_s: int = 3) -> str:
    return host.run(["curl", "-s", "-m", str(timeout_s), "-o", "/dev/null", "-w", "%{http_code}", *args, url]).stdout


def _stats(client: simhosts.Host, recorder: str) -> dict:
    """The recorder's /stats as a client host reads it ({} while it does not answer)."""
    res = client.run(["curl", "-s", "-m", "10", "-H", "Authorization: Bearer tok", f"{recorder}/stats"])
    try:
        return json.loads(res.stdout)
    except ValueError:
        return {}


def _answered(out_dir: Path) -> int:
    """The calls the traffic clients (``cluster.traffic``) have had answered so far."""
    try:
        return int((out_dir / "progress").read_text() or 0)
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with simhosts.SimulatedHosts(5, tmp_path_factory.mktemp("hosts")) as hs:
        yield hs


def test_a_host_sees_its_own_processes_files_and_name(hosts):
    h1, h2 = hosts[1], hosts[2]
    assert h1.run(["hostname"]).stdout.strip() == "h1"
    # names resolve as a cluster's DNS makes them, on the hosts only
    assert [h1.run(["getent", "hosts", n]).stdout.split()[:1] for n in ("h1", "h2")] == [[h1.address], [h2.address]]
    assert f"{h2.address} " not in Path("/etc/hosts").read_text()
    assert h1.run(["ps", "-e", "-o", "pid="]).stdout.split()[0] == "1"  # its own process table
    (h1.tmp / "only-on-h1").write_text("x")
    assert h1.run(["cat", "/tmp/only-on-h1"]).stdout == "x"
    assert "only-on-h1" not in h2.run(["ls", "/tmp"]).stdout.split()  # not on h2's disk
    sleeper = h2.popen(["sleep", "600"])
    assert str(sleeper.pid) not in h1.run(["ps", "-e", "-o", "pid="]).stdout.split()
    assert sleeper.pid in h2.pids()
    sleeper.stop()
    assert h2.run(["ip", "-4", "-o", "addr", "show", "eth0"]).stdout.split()[3] == f"{h2.address}/24"
    # this machine's loopback services are not a host's: its 127.0.0.1 is its own
    assert h1.run(["python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 5432), 3)"]).returncode != 0


def test_a_local_ray_cluster_starts_on_a_host_where_ray_never_ran(hosts):
    """A host's /tmp is new, as a fresh machine's is (no /tmp/ray): the local cluster the tests, the
    benches and ``make up`` use starts there (it once failed when no Ray had run on the machine before:
    Ray's cluster utilities write /tmp/ray/ray_current_cluster, which a temp dir of its own leaves out)."""
    h5 = hosts[5]
    assert h5.run(["test", "-e", "/tmp/ray"]).returncode == 1
    code = ("from pathlib import Path\nfrom prodrl_pipelines.cluster.local import LocalRayCluster\n"
            "with LocalRayCluster(Path('/tmp/lc'), nodes=1, cpus_per_node=1) as c:\n    print(c.gcs_address)")
    res = h5.run([sys.executable, "-c", code], env=_base_env(), timeout=300)
    assert res.returncode == 0 and res.stdout.strip().startswith("127.0.0.1:"), (res.stdout + res.stderr)[-3000:]
    assert h5.run(["ls", "/tmp"]).stdout.split().count("lc") == 1


def test_links_partitions_and_hosts_fail_as_a_network_does(hosts):
    h3, h4, h5 = hosts[3], hosts[4], hosts[5]
    server = h4.popen([sys.executable, "-m", "http.server", "8080", "--bind", h4.address])
    url = f"http://{h4.address}:8080/"
    try:
        until("h4's server answers h5", lambda: _http_code(h5, url) == "200", 120)
        hosts.partition(h4, h5)
        dropped = h5.run(["curl", "-s", "-m", "3", "-o", "/dev/null", url])
        assert dropped.returncode == 28, dropped  # curl's "timed out": packets dropped, nothing refused
        assert _http_code(h3, url) == "200"  # only h4 <-> h5 is cut
        hosts.heal(h4, h5)
        assert _http_code(h5, url) == "200"
        h4.cut()
        assert h5.run(["curl", "-s", "-m", "3", "-o", "/dev/null", url]).returncode == 28
        assert _http_code(h3, url) == "000"
        assert server.poll() is None  # the host runs on behind its cut link
        h4.restore()
        assert _http_code(h5, url) == "200"
        h4.power_off()
        assert server.poll() is not None and h4.pids() == []  # every process of the host went with it
        h4.boot()
        assert h4.pids() and _http_code(h5, url) == "000"  # back, empty: nothing listens
    finally:
        server.kill()
        h4.boot()


def test_a_crashed_runs_leftovers_are_removed_by_their_names_only(hosts, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has now: the run that made these is gone
    left = f"{simhosts.PREFIX_HEAD}{dead.pid}-beef-h1"
    subprocess.run(["ip", "netns", "add", left], check=True)
    stray = subprocess.Popen(["ip", "netns", "exec", left, "sleep", "600"], start_new_session=True)
    try:
        until("the stray process is in the leftover namespace",
               lambda: str(stray.pid) in subprocess.run(["ip", "netns", "pids", left], capture_output=True,
                                                         text=True).stdout.split(), 60)
        assert left in simhosts.clean_leftovers()
        assert stray.wait(60) == -signal.SIGKILL
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert left not in names
        assert all(h.netns in names for h in hosts.hosts)  # a live run's hosts are not touched
    finally:
        if stray.poll() is None:
            stray.kill()
        subprocess.run(["ip", "netns", "del", left], capture_output=True)


# ------------------------------------------------------------------ the fleet from a raylet-less host

@pytest.fixture(scope="module")
def ray_on_hosts(hosts):
    """A Ray head on h2 and a worker on h3 (2 CPUs each), moto S3 on h4; their processes end with the hosts."""
    h2, h3, h4 = hosts[2], hosts[3], hosts[4]
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true"}
    node_env = {**_base_env(), **creds, "PRODRL_NODE_CACHE": "/tmp/node-exports"}
    moto = str(Path(sys.executable).with_name("moto_server"))
    procs = [h4.popen([moto, "-H", h4.address, "-p", "9000"], env=_base_env(), log=h4.tmp / "moto.log")]
    dashboard, ray_procs = start_ray(h2, [h3], node_env)
    procs += ray_procs
    until("the S3 endpoint", lambda: _http_code(h3, f"http://{h4.address}:9000/") in ("200", "403", "404"), 120)
    driver_env = {**_base_env(), **creds, "PRODRL_S3_BUCKET": "fleet", "PRODRL_S3_PREFIX": "prod",
                  "PRODRL_S3_ENDPOINT_URL": f"http://{h4.address}:9000", "PRODRL_DEPLOY_API_KEY": KEY,
                  "PRODRL_SETTINGS_JSON": json.dumps({"cluster": "ray", "cluster_address": dashboard})}
    yield driver_env
    for p in procs:
        p.stop(grace_s=30)


@pytest.fixture(scope="module")
def pg_on_hosts(hosts):
    """PostgreSQL on h4 (Dagster's instance, the endpoint record); a test may stop and start it."""
    from prodrl_pipelines.cluster.host_services import HostPostgres

    pg = HostPostgres(hosts[4]).init()
    yield pg
    pg.stop()


def _on_h1(hosts, env: dict, *args: str, timeout_s: float = 600) -> dict:
    res = hosts[1].run([sys.executable, "-m", "prodrl_pipelines.cluster.fleet_driver", *args], env=env,
                       timeout=timeout_s)
    if res.returncode != 0:
        logs = sorted((hosts[2].tmp / "ray" / "session_latest" / "logs").glob("ray_client_server*.err"))
        head = "\n".join(f"--- h2 {p.name} ---\n{p.read_text(errors='replace')[-2000:]}" for p in logs)
        pytest.fail(f"{args} on h1 exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}\n{head}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_round_from_a_host_without_a_raylet_runs_on_the_ray_hosts_and_rolls_the_fleet_there(
        hosts, ray_on_hosts, pg_on_hosts):
    """The documented topology: Dagster's run worker on h1 (no raylet; its Dagster instance in
    PostgreSQL on h4, the store on h4's S3 endpoint) bootstraps and runs a round through the sensor:
    training as a Ray Train job with a rank on each Ray host (h2, h3), held-out evaluation and reward
    scoring as Ray jobs, the exports published to S3, the fleet placed on the Ray hosts through Ray
    Client and rolled to the round's version; lab traffic reaches it through a recorder on h1."""
    from prodrl_pipelines.cluster.host_services import round_from_host

    dashboard = json.loads(ray_on_hosts["PRODRL_SETTINGS_JSON"])["cluster_address"]
    got = round_from_host(hosts[1], ray_on_hosts, dashboard, pg_on_hosts.url)
    assert got["raylet_here"] is False and got["train_hosts"] == ["h2", "h3"] and got["train_nodes"] == 2, got
    assert got["decision"]["passed"] and got["decision"]["deployed"] and got["live"] == "round-000001", \
        json.dumps(got)
    assert {"round-000000", "round-000001"} <= set(got["exports"]), got  # the nodes fetch them from S3
    for step in ("train", "eval", "score"):
        assert f"prodrl-{step}-round-000001:SUCCEEDED" in got["jobs"], (step, got["jobs"])
    assert sorted(u.split("//")[1].split(":")[0] for u in got["replicas"]) == sorted(
        [hosts[2].address, hosts[3].address]), got


# ------------------------------------------------------------------ faults under recorder traffic

@pytest.fixture(scope="module")
def served_on_hosts(hosts, tiny_exports):
    """``prodrl serve`` of the tiny export on h2 and h3 (each its own copy, on its own disk), and the
    recorder on h1 following an endpoint file that lists both; the clients' host is h5."""
    h1, h2, h3 = hosts[1], hosts[2], hosts[3]
    procs = []
    for h in (h2, h3):
        shutil.copytree(tiny_exports["bf16"], h.tmp / "export", dirs_exist_ok=True)
        procs.append(h.popen([PRODRL, "serve", "/tmp/export", "--host", h.address,
                              "--port", "8000", "--served-model-name", "v1"], env=_base_env(), log=h.tmp / "serve.log"))
    from prodrl_pipelines.deploy_targets.base import Endpoint, EndpointFile

    urls = [f"http://{h.address}:8000" for h in (h2, h3)]
    (h1.tmp / "deployment").mkdir(exist_ok=True)
    EndpointFile(h1.tmp / "deployment" / "endpoint.json").write(Endpoint(
        urls[0], "v1", "v1", replicas=[{"url": u, "served_model_name": "v1", "policy_version": "v1"} for u in urls]))
    env = {**_base_env(), "PRODRL_RECORDER_TOKEN": "tok"}
    procs.append(h1.popen([PRODRL, "record", "--follow",
                           "/tmp/deployment/endpoint.json", "--store", "/tmp/store", "--host", h1.address, "--port",
                           "9100", "--upstream-timeout", "120"], env=env, log=h1.tmp / "record.log"))
    for u in urls:
        until(f"{u} serves", lambda u=u: _http_code(hosts[5], f"{u}/health") == "200", 300)
    until("the recorder answers", lambda: _http_code(hosts[5], f"http://{h1.address}:9100/health", "-H",
                                                      "Authorization: Bearer tok") == "200", 300)
    yield f"http://{h1.address}:9100", urls, procs[-1]
    for p in procs:
        p.stop(grace_s=60)


def test_a_partition_between_the_recorder_and_a_replica_fails_only_calls_in_flight_and_loses_no_record(
        hosts, served_on_hosts):
    """Three clients on h5 call through the recorder on h1 while h1 <-> h3 is partitioned (packets
    dropped: connections time out, nothing is refused) and then healed. The recorder's health check
    takes h3 out (``replicas_down``) and new calls go to h2; a call whose connection to h3 timed out is
    sent to h2 (nothing was sent); at most the calls in flight to h3 when it was cut fail (one per
    client); after the heal h3 is back in rotation; every acknowledged call is in the store once."""
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.store import TrajectoryStore

    h1, h3, h5 = hosts[1], hosts[3], hosts[5]
    recorder, urls, recorder_proc = served_on_hosts
    out = h5.tmp / "traffic"
    out.mkdir()
    traffic = h5.popen([sys.executable, "-m", "prodrl_pipelines.cluster.traffic", recorder, "tok", "/tmp/traffic", *CLIENTS],
                       env=_base_env(), log=h5.tmp / "traffic.log")

    def answered() -> int:
        return _answered(out)

    def stats() -> dict:
        return _stats(h5, recorder)

    try:
        until("calls answered before the partition", lambda: answered() >= 20, 300)
        hosts.partition(h1, h3)
        until("the recorder takes h3 out", lambda: urls[1] in stats().get("replicas_down", []), 300)
        cut_at = answered()
        until("calls answered during the partition", lambda: answered() >= cut_at + 30, 600)
        hosts.heal(h1, h3)
        until("h3 back in rotation", lambda: urls[1] not in stats().get("replicas_down", [urls[1]]), 300)
        healed_at = answered()
        until("calls answered after the heal", lambda: answered() >= healed_at + 30, 600)
    finally:
        (out / "stop").write_text("")
        traffic.wait(600)
        hosts.heal(h1, h3)
    result = json.loads((out / "result.json").read_text())
    counters = stats().get("counters", {})
    seen = {k: counters.get(k, 0) for k in ("replica_health_failures", "upstream_connect_timeouts",
                                            "upstream_replica_refused", "upstream_retries", "upstream_timeouts")}
    print(f"partition h1<->h3: {len(result['acked'])} calls answered, {len(result['failed'])} failed; {seen}")
    assert seen["replica_health_failures"] >= 1  # the recorder saw h3 go
    assert len(result["failed"]) <= 3, result["failed"]  # one call in flight per client at most
    recorder_proc.stop(grace_s=120)  # SIGTERM: the recorder flushes what it acknowledged
    calls = TrajectoryStore(LocalBlobStore(h1.tmp / "store")).read_calls(dedupe=False,
                                                                         columns=["trajectory_id", "call_index"])
    stored = list(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist()))
    assert len(stored) == len(set(stored))  # nothing twice
    assert {(t, i) for t, i, _, _ in result["acked"]} <= set(stored)  # every acknowledged call stored


def test_a_recorder_follows_the_endpoint_record_in_postgresql_on_another_host_through_a_database_restart(
        hosts, served_on_hosts, pg_on_hosts):
    """PostgreSQL on h4, the endpoint record written from h5 (no disk in common with the recorder), a
    recorder on h1 following ``URL#NAME``. The database is stopped under traffic (SIGINT: PostgreSQL's
    fast shutdown, connections cut) and started again: no call fails meanwhile (the recorder routes
    on the last record it read), a record written once it is back is followed, and every acknowledged
    call is stored once, filed under the version the record named when it was served."""
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.store import TrajectoryStore

    h1, h5 = hosts[1], hosts[5]
    _, urls, _ = served_on_hosts
    pg = pg_on_hosts
    where = f"{pg.url}#fleet"
    write = [sys.executable, "-m", "prodrl_pipelines.cluster.fleet_driver", "endpoint", where]
    h5.run([*write, "v1", json.dumps(urls)], env=_base_env(), check=True)
    recorder_proc = h1.popen([PRODRL, "record", "--follow", where, "--store", "/tmp/store-pg", "--host", h1.address,
                              "--port", "9200", "--upstream-timeout", "120"],
                             env={**_base_env(), "PRODRL_RECORDER_TOKEN": "tok"}, log=h1.tmp / "record-pg.log")
    recorder = f"http://{h1.address}:9200"
    until("the recorder answers", lambda: _http_code(h5, f"{recorder}/health", "-H", "Authorization: Bearer tok") == "200",
          300)
    out = h5.tmp / "traffic-pg"
    out.mkdir()
    traffic = h5.popen([sys.executable, "-m", "prodrl_pipelines.cluster.traffic", recorder, "tok", "/tmp/traffic-pg", *CLIENTS],
                       env=_base_env(), log=h5.tmp / "traffic-pg.log")

    def answered() -> int:
        return _answered(out)

    def recorded(version: str) -> int:
        res = h5.run(["curl", "-s", "-m", "10", "-H", "Authorization: Bearer tok", f"{recorder}/stats"])
        try:
            return int(json.loads(res.stdout).get("counters", {}).get(f"recorded_calls.version.{version}", 0))
        except ValueError:
            return 0

    try:
        until("calls answered before the restart", lambda: answered() >= 20, 300)
        pg.stop()
        down_at = answered()
        until("calls answered while the database is away", lambda: answered() >= down_at + 30, 600)
        pg.start()
        h5.run([*write, "v1b", json.dumps(urls)], env=_base_env(), check=True)
        until("calls filed under the record written after the restart", lambda: recorded("v1b") >= 10, 300)
    finally:
        (out / "stop").write_text("")
        traffic.wait(600)
        pg.stop()
    result = json.loads((out / "result.json").read_text())
    assert result["failed"] == [], result["failed"][:5]
    recorder_proc.stop(grace_s=120)  # SIGTERM: the recorder flushes what it acknowledged
    calls = TrajectoryStore(LocalBlobStore(h1.tmp / "store-pg")).read_calls(
        dedupe=False, columns=["trajectory_id", "call_index", "policy_version"])
    stored = list(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist()))
    assert len(stored) == len(set(stored)) and {(t, i) for t, i, *_ in result["acked"]} <= set(stored)
    assert set(calls.column("policy_version").to_pylist()) == {"v1", "v1b"}


# ------------------------------------------------ a Ray-placed fleet deployed from a host without a raylet
# (last: its replicas hold Ray resources until the module ends)

# the round's fleet above keeps a CPU of each 2-CPU Ray host: these replicas and a wave's new one share the other
SMALL_REPLICAS = {"replica_cpus": 0.5}


@pytest.fixture(scope="module")
def ray_fleet(hosts, ray_on_hosts, tiny_exports):
    """The deploy step on h1 (no raylet; the export on its disk only, published to S3 on h4) places two
    replicas of v1 on the Ray nodes through Ray Client, each node fetching the export from S3; at the
    end the fleet is stopped from h1, which must leave no actor or placement group."""
    h1 = hosts[1]
    for name in ("round-000001", "round-000002"):  # the same weights under two versions
        shutil.copytree(tiny_exports["bf16"], h1.tmp / "exports" / name)
    out = _on_h1(hosts, ray_on_hosts, "deploy", "/tmp/home", "/tmp/exports/round-000001", "v1",  # as h1 sees it
                 json.dumps(SMALL_REPLICAS))
    try:
        yield out
    finally:
        left = _on_h1(hosts, ray_on_hosts, "stop", "/tmp/home")
        assert left == {"placement_groups": [], "actors": []}, left


def test_a_fleet_deployed_from_a_host_without_a_raylet_serves_from_the_ray_nodes_with_its_key(hosts, ray_fleet):
    """Two waves placed the replicas on h2 and h3; a client on h5 is refused without the deployment's
    key and served with it."""
    h5 = hosts[5]
    out = ray_fleet
    assert out["raylet_here"] is False and out["waves"] == 2
    urls = [r["url"] for r in out["replicas"]]
    assert sorted(u.split("//")[1].split(":")[0] for u in urls) == sorted([hosts[2].address, hosts[3].address])
    for url in urls:
        body = json.dumps({"model": "v1", "prompt": [1, 5, 6, 7], "max_tokens": 2})
        assert _http_code(h5, f"{url}/v1/completions", "-H", "Content-Type: application/json", "-d", body,
                          timeout_s=60) == "401"
        assert _http_code(h5, f"{url}/v1/completions", "-H", "Content-Type: application/json", "-d", body,
                          "-H", f"Authorization: Bearer {KEY}", timeout_s=120) == "200"


def test_a_rolling_update_whose_second_node_is_cut_off_from_the_deployer_is_rolled_back_whole(
        hosts, ray_on_hosts, ray_fleet):
    """Under traffic through a recorder on h1, the link between h1 (the deploy step and the recorder)
    and the Ray worker host is cut (Ray's own traffic and the head stay up), then v2 is rolled out.
    Each wave's new server goes to the node the other slot is not on (``replica_spread``): the wave
    that lands on the cut-off node never answers h1's health check and the roll-out is rejected. When
    that is wave 2, wave 1 (committed on the head) is brought back to v1; when it is wave 1, nothing
    changed. Either way every slot and the endpoint record end on v1, never a committed mix. Calls
    fail only if in flight to the cut-off node when the link went (at most one per client), every
    acknowledged call is stored once, and once the link is back the recorder takes that replica back
    into rotation."""
    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.store import TrajectoryStore

    h1, h5 = hosts[1], hosts[5]
    cut = hosts[3]  # the Ray worker
    on_cut = next(i for i, s in enumerate(ray_fleet["slots"]) if f"//{cut.address}:" in s["url"])
    cut_url = ray_fleet["slots"][on_cut]["url"]
    env = {**ray_on_hosts, "PRODRL_RECORDER_TOKEN": "tok"}  # the recorder sends the deployment's key upstream
    recorder_proc = h1.popen([PRODRL, "record", "--follow", "/tmp/home/deployment/endpoint.json", "--store",
                              "/tmp/store-roll", "--host", h1.address, "--port", "9300", "--upstream-timeout", "120"],
                             env=env, log=h1.tmp / "record-roll.log")
    recorder = f"http://{h1.address}:9300"

    def stats() -> dict:
        return _stats(h5, recorder)

    until("the recorder answers", lambda: _http_code(h5, f"{recorder}/health", "-H", "Authorization: Bearer tok")
          == "200", 300)
    out_dir = h5.tmp / "traffic-roll"
    out_dir.mkdir()
    traffic = h5.popen([sys.executable, "-m", "prodrl_pipelines.cluster.traffic", recorder, "tok", "/tmp/traffic-roll",
                        *CLIENTS], env=_base_env(), log=h5.tmp / "traffic-roll.log")

    def answered() -> int:
        return _answered(out_dir)

    try:
        until("calls answered before the cut", lambda: answered() >= 20, 300)
        hosts.partition(h1, cut)
        got = _on_h1(hosts, ray_on_hosts, "deploy", "/tmp/home", "/tmp/exports/round-000002", "v2",
                     json.dumps({**SMALL_REPLICAS, "health_timeout_s": 60}))
        after = answered()
        until("calls answered after the roll-back", lambda: answered() >= after + 20, 600)
        hosts.heal(h1, cut)
        until("the cut-off replica back in rotation", lambda: cut_url not in stats().get("replicas_down", [cut_url]),
              300)
    finally:
        (out_dir / "stop").write_text("")
        traffic.wait(600)
        hosts.heal(h1, cut)
    wave = on_cut + 1  # slot i's new server avoids the other slot's node: it lands on the cut-off one when i = on_cut
    assert f"wave {wave}/2" in got.get("rejected", ""), got
    assert ("restored replica 0: v1" if wave == 2 else "nothing changed") in got["rollback"], got
    assert [s["version"] for s in got["slots"]] == ["v1", "v1"], got
    assert [r["policy_version"] for r in got["replicas"]] == ["v1", "v1"], got
    assert got["slots"][on_cut]["url"] == cut_url  # the cut-off node's server was never replaced
    result = json.loads((out_dir / "result.json").read_text())
    print(f"rolling update with {cut.name} cut off: {got['rejected']}; {got['rollback']}; "
          f"{len(result['acked'])} calls answered, {len(result['failed'])} failed")
    assert len(result["failed"]) <= 3, result["failed"]  # one call in flight per client at most
    recorder_proc.stop(grace_s=120)  # SIGTERM: the recorder flushes what it acknowledged
    calls = TrajectoryStore(LocalBlobStore(h1.tmp / "store-roll")).read_calls(
        dedupe=False, columns=["trajectory_id", "call_index", "policy_version"])
    stored = list(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist()))
    assert len(stored) == len(set(stored)) and {(t, i) for t, i, *_ in result["acked"]} <= set(stored)
    assert set(calls.column("policy_version").to_pylist()) <= {"v1", "v2"}
