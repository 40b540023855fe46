"""A deployment of several replicas behind one address: the recorder's balancer (least requests in
flight, health, a sticky canary slice), rolling updates in waves under steady traffic, and a probe
failure in a later wave that restores the waves already updated. ``prodrl serve`` replicas of a
tiny policy; every call goes through ``prodrl record --follow`` as clients' would."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import httpx
import pytest

from prodrl_pipelines.config.settings import Settings
from prodrl_pipelines.deploy_targets import endpoint_file, make_target
from prodrl_pipelines.deploy_targets.base import Endpoint
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_location
from prodrl_pipelines.deploy_targets.processes import pick_port_range
from prodrl_pipelines.deploy_targets.rollout import DeployRejected, roll_out
from prodrl_pipelines.deploy_targets.server_records import record_alive
from prodrl_pipelines.deploy_targets.servers import ProdrlServeTarget
from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.recorder.balancer import Balancer, Choice, canary_share
from tests.helpers import until, watch_endpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42, 9, 9], [1, 12, 13]]


# ------------------------------------------------------------------------------------ the balancer

def _ep(*urls, canary=None, fraction=0.0):
    reps = [{"url": u, "served_model_name": f"m{i}", "policy_version": "v1"} for i, u in enumerate(urls)]
    can = {"fraction": fraction, "policy_version": "v2",
           "replicas": [{"url": canary, "served_model_name": "c", "policy_version": "v2"}]} if canary else None
    return Endpoint(urls[0], "m0", "v1", replicas=reps, canary=can)


def test_least_outstanding_and_rotation_among_equals():
    b, ep = Balancer(), _ep("http://a", "http://b", "http://c")
    firsts = {b.pick(ep, None).url for _ in range(6)}
    assert firsts == {"http://a", "http://b", "http://c"}  # idle replicas share the load
    a = b.pick(ep, None)
    b.started(a)
    b.started(a)
    other = b.pick(ep, None)
    b.started(other)
    assert b.pick(ep, None).url not in (a.url, other.url)  # the idle one
    b.finished(a)
    b.finished(a)
    assert b.outstanding()[a.url] == 0 and b.outstanding()[other.url] == 1


def test_a_replica_that_is_down_is_skipped_then_comes_back():
    now = [0.0]
    b, ep = Balancer(down_s=2.0, clock=lambda: now[0]), _ep("http://a", "http://b")
    b.mark_down("http://a")
    assert {b.pick(ep, None).url for _ in range(4)} == {"http://b"} and b.down() == ["http://a"]
    assert b.pick(ep, None, exclude=frozenset({"http://b"})).url == "http://a"  # all others tried: try it
    now[0] = 2.5  # the down window passed (the health loop renews it while /health fails)
    assert {b.pick(ep, None).url for _ in range(4)} == {"http://a", "http://b"} and b.down() == []
    b.mark_down("http://b")
    b.mark_up("http://b")
    assert b.down() == []
    assert b.pick(ep, None, exclude=frozenset({"http://a", "http://b"})) is None


def test_a_session_stays_on_its_replica_within_a_bounded_imbalance():
    now = [0.0]
    b, ep = Balancer(clock=lambda: now[0], sticky_slack=2), _ep("http://a", "http://b", "http://c")
    first = {t: b.pick(ep, t).url for t in ("s1", "s2", "s3")}
    assert set(first.values()) == {"http://a", "http://b", "http://c"}  # new sessions spread
    for _ in range(5):  # idle or equally loaded: every next call goes back to the session's replica
        assert {t: b.pick(ep, t).url for t in first} == first
    home = first["s1"]
    busy = Choice(home, "v0", "v0")
    for _ in range(2):
        b.started(busy)
    assert b.pick(ep, "s1").url == home  # 2 more in flight than the least loaded: within the slack
    b.started(busy)
    moved = b.pick(ep, "s1").url
    assert moved != home and b.sticky_moves == 1  # 3 more: the call goes to the least loaded ...
    for _ in range(3):
        b.finished(busy)
    assert b.pick(ep, "s1").url == moved  # ... and the session stays there
    b.mark_down(moved)
    again = b.pick(ep, "s1").url
    assert again != moved and b.sticky_moves == 2  # its replica down: it moves
    assert b.pick(ep, "s1", exclude=frozenset({again})).url != again  # a refused one is excluded
    assert b.crossings == 0  # every move stayed on the session's version


def test_without_session_affinity_each_call_goes_to_the_least_loaded_replica_of_its_version():
    b, ep = Balancer(sticky=False), _ep("http://a", "http://b")
    b.started(Choice("http://a", "v0", "v0"))  # a is busy: every call of a session goes to b
    assert {b.pick(ep, "s1").url for _ in range(4)} == {"http://b"}
    b.finished(Choice("http://a", "v0", "v0"))
    b.started(Choice("http://b", "v0", "v0"))  # now b is: the session leaves it, no stickiness held it
    assert b.pick(ep, "s1").url == "http://a" and b.sticky_moves == 0
    assert b.version_of("s1") == "v1"  # the episode is still kept on its version


def test_canary_slice_is_sticky_per_trajectory_and_its_fraction():
    ids = [f"traj-{i}" for i in range(20000)]
    shares = [canary_share(t) for t in ids]
    assert all(0 <= s < 1 for s in shares) and shares == [canary_share(t) for t in ids]  # a pure function
    frac = sum(s < 0.1 for s in shares) / len(ids)
    assert abs(frac - 0.1) < 4 * (0.1 * 0.9 / len(ids)) ** 0.5  # binomial: within 4 sd of 10%
    b, ep = Balancer(), _ep("http://a", "http://b", canary="http://canary", fraction=0.1)
    for t in ids[:500]:  # every call of a trajectory goes to one group, whatever the load
        picks = {b.pick(ep, t).canary for _ in range(3)}
        assert picks == {canary_share(t) < 0.1}
    assert b.pick(ep, None).canary is False  # no trajectory id: the stable replicas


# ------------------------------------------------------------------------------------ a real fleet

class Traffic:
    """Steady completions through the recorder, each its own trajectory; failures kept with reasons."""

    # a short pause per client: calls are in flight at every switch, without taking a whole core from
    # the suite running beside it for the test's length
    def __init__(self, url: str, workers: int = 3, pause_s: float = 0.05) -> None:
        self.url, self.pause_s = url, pause_s
        self.failures: list[str] = []
        self.sent = 0
        self.served: Counter = Counter()  # answers by the served model name (the policy version)
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(workers)
        self.futs = [self.pool.submit(self._run, i) for i in range(workers)]

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(base_url=self.url, headers={"Authorization": "Bearer t"}, timeout=120) as h:
            while not self.stop.is_set():
                try:
                    r = h.post("/v1/completions", json={"model": "any", "prompt": PROMPTS[n % 3], "max_tokens": 4},
                               headers={"X-Trajectory-Id": f"w{i}-{n}"})
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code}: {r.text[:200]}")
                    else:
                        self.served[r.json().get("model")] += 1
                except httpx.HTTPError as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                n += 1
                time.sleep(self.pause_s)
        self.sent += n

    def finish(self) -> int:
        self.stop.set()
        for f in self.futs:
            f.result()
        self.pool.shutdown()
        return self.sent

    def wait_served(self, version: str, at_least: int = 1, timeout_s: float = 180.0) -> None:
        """Until ``at_least`` answers from ``version`` came back (however slowly the loaded machine serves)."""
        deadline = time.monotonic() + timeout_s
        while self.served[version] < at_least:
            assert time.monotonic() < deadline and not self.failures, (version, self.served, self.failures[:3])
            time.sleep(0.1)


def _fleet(tmp_path, replicas=3, **deploy):
    s = Settings(home=str(tmp_path / "home"), deploy={
        "target": "prodrl-serve", "target_port": pick_port_range(2 * replicas + 2), "replicas": replicas,
        "max_unavailable": 1, "probe_prompts": 3, "max_tokens": 6, "export_scheme": "bf16", **deploy})
    return s, make_target(s)


@pytest.mark.long(seconds=105)
def test_rolling_update_of_three_replicas_fails_no_call_and_tags_each_with_its_version(tiny_exports, tmp_path):
    s, target = _fleet(tmp_path)
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                            store_dir=str(tmp_path / "store"), token="t", top_logprobs=4))
    try:
        first = roll_out(s, target, tiny_exports["bf16"], "v1", PROMPTS)
        assert first.waves == 3 and [r.policy_version for r in target.currents()] == ["v1"] * 3
        with BackgroundServer(app) as rec:
            traffic = Traffic(rec.url)
            traffic.wait_served("v1", 10)  # calls before the waves, counted rather than timed
            with watch_endpoint(s.home_path) as seen:  # the endpoint file's versions while the waves run
                ro = roll_out(s, ProdrlServeTarget(s, s.home_path), tiny_exports["bf16"], "v2", PROMPTS)  # a later run
                traffic.wait_served("v2", 11)  # and after them
            sent = traffic.finish()
            assert not traffic.failures, traffic.failures[:5]
            assert ro.waves == 3 and ro.probe.passed
            # never fewer than N - max_unavailable replicas listed; versions mixed only between waves
            assert all(len(v) == 3 for v in seen) and ["v1", "v1", "v1"] in seen and seen[-1] == ["v2"] * 3
            assert {tuple(v) for v in seen} <= {("v1",) * 3, ("v2", "v1", "v1"), ("v2", "v2", "v1"), ("v2",) * 3}
            assert app.state.recorder.ingestor.flush(30)
            rows = app.state.recorder.store.read_calls().to_pylist()
            assert len(rows) == sent > 20
            assert {r["policy_version"] for r in rows} == {"v1", "v2"}
            stats = httpx.get(rec.url + "/stats", headers={"Authorization": "Bearer t"}).json()
            by_version = {k.rsplit(".", 1)[1]: v for k, v in stats["counters"].items()
                          if k.startswith("recorded_calls.version.")}
            assert by_version == {v: sum(r["policy_version"] == v for r in rows) for v in ("v1", "v2")}

            # a replica that dies is taken out (no call fails), and comes back once healthy again
            victim = target.current(1)
            traffic = Traffic(rec.url)
            os.killpg(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 120  # a ceiling: the health loop is slower on a loaded machine
            while victim.url not in httpx.get(rec.url + "/stats", headers={"Authorization": "Bearer t"}).json()["replicas_down"]:
                assert time.monotonic() < deadline, "the dead replica was never taken out"
                time.sleep(0.2)
            back = target.start(tiny_exports["bf16"], "v2", victim.port, 1)
            deadline = time.monotonic() + 180
            while victim.url in httpx.get(rec.url + "/stats", headers={"Authorization": "Bearer t"}).json()["replicas_down"]:
                assert time.monotonic() < deadline, "the restarted replica never came back"
                time.sleep(0.2)
            time.sleep(0.5)
            traffic.finish()
            assert not traffic.failures, traffic.failures[:5]
            os.killpg(back.pid, signal.SIGKILL)
    finally:
        target.stop()


@pytest.mark.long(seconds=60)
def test_a_fleet_whose_endpoint_is_a_database_row_is_followed_by_a_recorder_that_shares_no_disk_with_it(
        tiny_exports, tmp_path, pg_url):
    """``deploy.endpoint_store``: the deploy step writes the endpoint record and its slots' records to
    PostgreSQL and nothing to its home; a recorder given only ``URL#NAME`` (its own directory, as on
    another host) serves and files every call under the version that answered, through a blue/green
    switch that a run worker on another host makes (its own empty home: it finds the serving server
    through the database, starts beside it on the other port and stops it; the waves of a larger fleet
    write the records the same way)."""
    s, target = _fleet(tmp_path, replicas=1, endpoint_store=pg_url, endpoint_name="fleet-a")
    where = endpoint_location(s.home_path, s.deploy)
    assert where == f"{pg_url}#fleet-a"
    app = build_recorder_app(RecorderConfig(upstream="", follow=where, store_dir=str(tmp_path / "elsewhere"),
                                            token="t", top_logprobs=4))
    try:
        roll_out(s, target, tiny_exports["bf16"], "v1", PROMPTS)
        with BackgroundServer(app) as rec:
            # a follower reads the row every 0.5 s: it is ready once it has read the deployment (as a load
            # balancer waits for /health/ready before it sends calls)
            until("the recorder has read the row", lambda: httpx.get(rec.url + "/health/ready", timeout=60).status_code
                  == 200, 120, every_s=0.1)
            traffic = Traffic(rec.url)
            traffic.wait_served("v1", 6)
            v1 = target.current(0)
            elsewhere = s.model_copy(update={"home": str(tmp_path / "host-b")})  # shares only the database
            ro = roll_out(elsewhere, ProdrlServeTarget(elsewhere, elsewhere.home_path), tiny_exports["bf16"], "v2",
                          PROMPTS)
            traffic.wait_served("v2", 6)
            sent = traffic.finish()
            assert not traffic.failures and ro.waves == 1, traffic.failures[:5]
            v2 = target.current(0)  # the first host reads what the second deployed
            assert v2.policy_version == "v2" and v2.port != v1.port and not v1.alive()
            assert app.state.recorder.ingestor.flush(30)
            rows = app.state.recorder.store.read_calls().to_pylist()
            assert len(rows) == sent and {r["policy_version"] for r in rows} == {"v1", "v2"}
        for home in (s.home_path, tmp_path / "host-b"):  # no record on either host's disk, logs only
            assert not [p for p in (home / "deployment").rglob("*.json")], home
        assert [r["policy_version"] for r in endpoint_file(s.home_path, s.deploy).read().replica_list()] == ["v2"]
    finally:
        target.stop()


@pytest.mark.long(seconds=60)
def test_a_probe_failure_in_the_second_wave_restores_the_first(tiny_exports, tmp_path):
    """Replica 1's server is broken (it serves W4A4 weights under the bf16 name): wave 1 passes, wave 2's
    probe fails, wave 2 is stopped and wave 1 brought back to v1; every replica serves v1 again. Then a
    cluster error (not a ``DeployError``) starting wave 2 of v3: rejected, wave 1 restored the same way."""
    s, target = _fleet(tmp_path, probe_mean_bound=1e-4)

    class BrokenSecondReplica(ProdrlServeTarget):
        def command(self, export_dir, port, policy_version):
            broken = policy_version == "v2" and port in self._ports(1)
            return super().command(tiny_exports["nvfp4-w4a4"] if broken else export_dir, port, policy_version)

    try:
        roll_out(s, target, tiny_exports["bf16"], "v1", PROMPTS)
        v1_pids = [r.pid for r in target.currents()]
        with pytest.raises(DeployRejected) as err:
            roll_out(s, BrokenSecondReplica(s, s.home_path), tiny_exports["bf16"], "v2", PROMPTS)
        e = err.value
        assert "parity probe failed" in e.reason and "wave 2/3" in e.reason, e.reason
        assert "restored replica 0: v1" in e.rollback, e.rollback
        assert [r.policy_version for r in target.currents()] == ["v1"] * 3
        assert target.current(0).pid != v1_pids[0] and [r.pid for r in target.currents()][1:] == v1_pids[1:]
        assert not record_alive(e.switch.detail)
        ep = endpoint_file(s.home_path).read()
        assert ep.policy_version == "v1" and [r["policy_version"] for r in ep.replica_list()] == ["v1"] * 3
        assert asdict(ep)["replicas"][0]["url"] == target.current(0).url

        class ClusterErrorInSecondWave(ProdrlServeTarget):  # what Ray raises (GetTimeoutError is one)
            def start(self, export_dir, policy_version, port, slot=0):
                if slot == 1:
                    raise TimeoutError("the node did not answer")
                return super().start(export_dir, policy_version, port, slot)

        with pytest.raises(DeployRejected) as err:
            roll_out(s, ClusterErrorInSecondWave(s, s.home_path), tiny_exports["bf16"], "v3", PROMPTS)
        e = err.value
        assert "wave 2/3" in e.reason and "TimeoutError: the node did not answer" in e.reason, e.reason
        assert "restored replica 0: v1" in e.rollback, e.rollback
        assert [r.policy_version for r in target.currents()] == ["v1"] * 3
        ep = endpoint_file(s.home_path).read()
        assert ep.policy_version == "v1" and [r["policy_version"] for r in ep.replica_list()] == ["v1"] * 3
    finally:
        target.stop()
