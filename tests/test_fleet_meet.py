"""Where fleets meet the other features: an episode kept on one policy version across a rolling wave
and from the moment a canary starts, a canary whose server crashes (its slice falls back to the
stable replicas, the canary is paused with the reason), every new server of a wave probed, a commit
that fails half-way restored, and endpoint-file updates that cannot put back a stopped canary.

The balancer and the endpoint file are tested directly; the rest on one module-wide fleet of two
``prodrl serve`` replicas of the tiny policy behind ``prodrl record --follow``, every call going
through the recorder as a client's would."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import httpx
import pytest

from prodrl_pipelines.config.settings import Settings
from prodrl_pipelines.deploy_targets import endpoint_file, make_target
from prodrl_pipelines.deploy_targets import fleet_canary as fleet_canary_mod
from prodrl_pipelines.deploy_targets import servers as servers_mod
from prodrl_pipelines.deploy_targets.base import Endpoint, Switch
from prodrl_pipelines.deploy_targets.processes import pick_port_range
from prodrl_pipelines.deploy_targets.rollout import DeployRejected, roll_out, start_canary
from prodrl_pipelines.deploy_targets.server_records import ServerRecord, record_alive
from prodrl_pipelines.deploy_targets.servers import ProdrlServeTarget
from prodrl_pipelines.engines.server import BackgroundServer
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
from prodrl_pipelines.recorder.balancer import Balancer, canary_share
from tests.helpers import until

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42, 9, 9], [1, 12, 13]]
HEADERS = {"Authorization": "Bearer t"}


# ------------------------------------------------------------------------------------ the balancer

def _ep(*replicas, canary=None, fraction=0.0):
    """An endpoint of (url, version) replicas and an optional (url, version) canary."""
    reps = [{"url": u, "served_model_name": v, "policy_version": v} for u, v in replicas]
    can = {"fraction": fraction, "policy_version": canary[1],
           "replicas": [{"url": canary[0], "served_model_name": canary[1], "policy_version": canary[1]}]} \
        if canary else None
    return Endpoint(reps[0]["url"], reps[0]["served_model_name"], reps[0]["policy_version"], replicas=reps, canary=can)


def test_an_episode_keeps_its_version_through_a_rolling_wave_and_crosses_only_when_none_is_left():
    b = Balancer()
    episodes = [f"ep-{i}" for i in range(12)]
    assert {b.pick(_ep(("a", "v1"), ("b", "v1"), ("c", "v1")), t).policy_version for t in episodes} == {"v1"}
    # wave 1 replaced replica a; the old replicas are busy, so least-requests alone would pick the new one
    wave1 = _ep(("a2", "v2"), ("b", "v1"), ("c", "v1"))
    for _ in range(5):
        b.started(b.pick(wave1, None, exclude=frozenset({"a2", "c"})))
        b.started(b.pick(wave1, None, exclude=frozenset({"a2", "b"})))
    for t in episodes:
        assert b.pick(wave1, t).policy_version == "v1", t  # call 1 stays on the version of call 0
    fresh = [f"new-{i}" for i in range(6)]
    assert {b.pick(wave1, t).url for t in fresh} == {"a2"}  # new episodes: the idle new replica
    for _ in range(20):  # now the new replica is the busiest: new episodes still stay on it
        b.started(b.pick(wave1, None, exclude=frozenset({"b", "c"})))
    assert {b.pick(wave1, t).policy_version for t in fresh} == {"v2"}
    wave2 = _ep(("a2", "v2"), ("b2", "v2"), ("c", "v1"))
    assert {b.pick(wave2, t).url for t in episodes} == {"c"}  # the last old replica, however busy
    assert b.crossings == 0
    done = _ep(("a2", "v2"), ("b2", "v2"), ("c2", "v2"))
    assert {b.pick(done, t).policy_version for t in episodes} == {"v2"}  # none left: the episode crosses
    assert b.crossings == len(episodes)
    assert {b.version_of(t) for t in episodes} == {"v2"}  # and stays on the version that served it since
    assert {b.pick(wave1, t).policy_version for t in episodes} == {"v2"}


def test_an_episode_that_started_before_the_canary_never_enters_it():
    b = Balancer()
    inside = [t for t in (f"t{i}" for i in range(200)) if canary_share(t) < 0.5]
    stable = _ep(("a", "v1"), ("b", "v1"))
    assert {b.pick(stable, t).policy_version for t in inside} == {"v1"}  # call 0: no canary yet
    with_canary = _ep(("a", "v1"), ("b", "v1"), canary=("can", "v2"), fraction=0.5)
    assert {b.pick(with_canary, t).policy_version for t in inside} == {"v1"}  # call 1: same version
    later = [t for t in (f"u{i}" for i in range(200)) if canary_share(t) < 0.5]
    assert {b.pick(with_canary, t).url for t in later} == {"can"}  # episodes that start now: the canary
    assert b.crossings == 0


def test_a_canary_that_refuses_connections_falls_back_to_the_stable_replicas_and_is_paused(tmp_path):
    file = endpoint_file(tmp_path)
    file.write(_ep(("a", "v1"), ("b", "v1"), canary=("can", "v2"), fraction=1.0))
    plain = Balancer()  # how the recorder retries a refused call: the url excluded, picked again
    first = plain.pick(file.read(), "episode")
    assert first.canary and first.url == "can"
    plain.mark_down(first.url)
    again = plain.pick(file.read(), "episode", exclude=frozenset({"can"}))
    assert again is not None and again.policy_version == "v1" and not again.canary
    assert plain.pick(file.read(), "another").policy_version == "v1"  # a canary marked down takes no new episode

    b = Balancer(endpoints=file, refusals_to_pause=3)
    first = b.pick(file.read(), "episode")
    assert not b.refused(first, ConnectionRefusedError(111, "Connection refused"))
    assert b.pick(file.read(), "episode", exclude=frozenset({"can"})).policy_version == "v1"
    assert file.read().canary_paused() is None
    assert not b.refused(first)  # the health loop's checks refuse too
    assert b.refused(first, ConnectionRefusedError(111, "Connection refused"))
    assert b.groups(file.read())[1] == []  # decided: no traffic, before the file is written
    b.settle(120)
    reason = file.read().canary_paused()
    assert reason and "can (v2) could not be connected to 3 times" in reason and "stable replicas" in reason, reason
    assert b.groups(file.read())[1] == []  # paused: no traffic, whatever its health says later
    b.mark_up("can")
    assert {b.pick(file.read(), f"n{i}").policy_version for i in range(20)} == {"v1"}
    assert not b.refused(first)  # recorded once
    # a canary stopped (or replaced) meanwhile is not paused
    file.update(lambda ep: Endpoint(**{**asdict(ep), "canary": None}))
    assert not file.pause_canary("can", "v2", "late") and file.read().canary is None


def test_pausing_a_canary_never_waits_for_the_endpoint_files_lock(tmp_path):
    """A deploy may hold the endpoint file's lock for a while (Ray calls); the recorder decides a pause
    on its event loop, so ``refused`` returns with the lock still held, the canary takes no traffic at
    once, and the pause is written when the lock is free."""
    import threading

    file = endpoint_file(tmp_path)
    file.write(_ep(("a", "v1"), canary=("can", "v2"), fraction=1.0))
    b = Balancer(endpoints=file, refusals_to_pause=1)
    first = b.pick(file.read(), "episode")
    holding, release = threading.Event(), threading.Event()

    def deploy_holding_the_lock():
        with file.locked():
            holding.set()
            release.wait(600)

    holder = threading.Thread(target=deploy_holding_the_lock, daemon=True)
    holder.start()
    assert holding.wait(120)
    decided = []
    caller = threading.Thread(target=lambda: decided.append(b.refused(first, ConnectionRefusedError(111, "refused"))),
                              daemon=True)
    caller.start()
    caller.join(120)  # a blocked call would still be waiting: the lock is released only below
    try:
        assert decided == [True], "refused() waited for the endpoint file's lock"
        assert b.pick(file.read(), "another-episode").policy_version == "v1"
        assert file.read().canary_paused() is None  # not written yet: the lock is held
    finally:
        release.set()
        holder.join(120)
    b.settle(120)
    assert "could not be connected to 1 times" in (file.read().canary_paused() or "")


# --------------------------------------------------------------- endpoint-file updates under a lock

def _sleeper() -> subprocess.Popen:
    """A process standing for a server (alive, its own session: stopping it touches nothing else)."""
    return subprocess.Popen(["sleep", "600"], start_new_session=True)


def _record(proc, port, version, home) -> dict:
    return asdict(ServerRecord(pid=proc.pid, port=port, url=f"http://127.0.0.1:{port}", policy_version=version,
                               export_dir=str(home), log=str(home / "log"), started_at=time.time()))


def test_concurrent_endpoint_writers_cannot_resurrect_a_stopped_canary(tmp_path, monkeypatch):
    """A deploy rewriting the endpoint file (``write_endpoint``) from several threads while a canary is
    committed and stopped over and over: once ``stop_canary`` returned, the canary stays gone."""
    monkeypatch.setattr(servers_mod, "DRAIN_S", 0.0)
    monkeypatch.setattr(fleet_canary_mod, "CANARY_DRAIN_S", 0.0)  # the drain is not what is tested
    s = Settings(home=str(tmp_path / "home"), deploy={"target": "prodrl-serve", "target_port": 20000,
                                                      "replicas": 2})
    target = ProdrlServeTarget(s, s.home_path)
    fleet = [_sleeper(), _sleeper()]
    try:
        for slot, proc in enumerate(fleet):
            target.slots.write(slot, "current", _record(proc, 20000 + 2 * slot, "v1", tmp_path))
        target.write_endpoint("v1", str(tmp_path))
        resurrected = 0
        for _ in range(15):
            canary = _sleeper()
            target.slots.write(target.CANARY, "pending", _record(canary, 20004, "c1", tmp_path))
            target.commit_canary(Switch("prodrl-serve", "c1", str(tmp_path), "http://127.0.0.1:20004", "c1",
                                        detail={"pid": canary.pid}), 0.5)
            assert endpoint_file(s.home_path).read().canary["policy_version"] == "c1"
            stop, writes = threading.Event(), [0, 0, 0]

            def writer(i):
                while not stop.is_set() or writes[i] < 3:
                    target.write_endpoint("v1", str(tmp_path))
                    writes[i] += 1

            with ThreadPoolExecutor(3) as pool:
                futs = [pool.submit(writer, i) for i in range(3)]
                while min(writes) < 2:
                    time.sleep(0.001)
                assert "stopped the canary" in target.stop_canary()
                after = list(writes)
                stop.set()
                while any(w - a < 2 for w, a in zip(writes, after)) and not all(f.done() for f in futs):
                    time.sleep(0.001)
                for f in futs:
                    f.result()
            resurrected += endpoint_file(s.home_path).read().canary is not None
            canary.wait(60)
            target.stop_canary()  # clean up whatever came back, for the next round
        assert resurrected == 0, f"a stopped canary came back in {resurrected} of 15 rounds"
        ep = endpoint_file(s.home_path).read()
        assert [r["policy_version"] for r in ep.replica_list()] == ["v1", "v1"]
    finally:
        for p in fleet:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ------------------------------------------------------------------------------------ a real fleet

@pytest.fixture(scope="module")
def fleet(tiny_exports, tmp_path_factory):
    """Two replicas serving v1 behind a recorder that follows their endpoint file."""
    tmp = tmp_path_factory.mktemp("fleet_meet")
    s = Settings(home=str(tmp / "home"), deploy={
        "target": "prodrl-serve", "target_port": pick_port_range(6), "replicas": 2, "max_unavailable": 1,
        "probe_prompts": 3, "max_tokens": 6, "export_scheme": "bf16"})
    target = make_target(s)
    app = build_recorder_app(RecorderConfig(upstream="", follow=str(endpoint_file(s.home_path).path),
                                            store_dir=str(tmp / "store"), token="t", top_logprobs=4))
    try:
        roll_out(s, target, tiny_exports["bf16"], "v1", PROMPTS)
        with BackgroundServer(app) as rec, httpx.Client(base_url=rec.url, headers=HEADERS, timeout=120) as client:
            yield s, target, app.state.recorder, client
    finally:
        target.stop()


def _call(client, tid: str, n: int = 0) -> str:
    """One call of episode ``tid`` through the recorder; the version that answered."""
    r = client.post("/v1/completions", json={"model": "any", "prompt": PROMPTS[n % 3], "max_tokens": 4},
                    headers={"X-Trajectory-Id": tid})
    assert r.status_code == 200, r.text
    return r.json()["model"]


def _versions_by_episode(recorder, prefix: str) -> dict[str, list[str]]:
    assert recorder.ingestor.flush(30)
    rows = sorted((r["trajectory_id"], r["call_index"], r["policy_version"])
                  for r in recorder.store.read_calls().to_pylist() if r["trajectory_id"].startswith(prefix))
    out: dict[str, list[str]] = {}
    for tid, _, v in rows:
        out.setdefault(tid, []).append(v)
    return out


class Episodes:
    """Workers each running episodes of ``calls`` calls through the recorder; failures kept."""

    def __init__(self, url: str, prefix: str, workers: int = 3, calls: int = 4) -> None:
        self.failures: list[str] = []
        self.done: list[list[str]] = []  # the versions that answered each finished episode
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(workers)
        self.futs = [self.pool.submit(self._run, url, f"{prefix}-w{i}", calls) for i in range(workers)]

    def _run(self, url, prefix, calls) -> None:
        n = 0
        with httpx.Client(base_url=url, headers=HEADERS, timeout=120) as h:
            while not self.stop.is_set():
                versions = []
                for k in range(calls):  # an episode is never cut short: its calls all go out
                    try:
                        r = h.post("/v1/completions", json={"model": "any", "prompt": PROMPTS[k % 3], "max_tokens": 4},
                                   headers={"X-Trajectory-Id": f"{prefix}-{n}"})
                        if r.status_code != 200:
                            self.failures.append(f"{r.status_code}: {r.text[:200]}")
                        else:
                            versions.append(r.json()["model"])
                    except httpx.HTTPError as e:
                        self.failures.append(f"{type(e).__name__}: {e}")
                    time.sleep(0.02)
                self.done.append(versions)
                n += 1

    def wait_whole(self, version: str, timeout_s: float = 180.0) -> None:
        """Until an episode ran whole on ``version`` (however slowly the loaded machine serves)."""
        deadline = time.monotonic() + timeout_s
        while not any(v and set(v) == {version} for v in list(self.done)):
            assert time.monotonic() < deadline and not self.failures, (version, self.done[-5:], self.failures[:3])
            time.sleep(0.1)

    def finish(self) -> None:
        self.stop.set()
        for f in self.futs:
            f.result()
        self.pool.shutdown()


def _live(target) -> str:
    versions = {r.policy_version for r in target.currents()}
    assert len(versions) == 1, versions
    return versions.pop()


@pytest.mark.long(seconds=60)
def test_episodes_stay_on_one_version_through_a_rolling_wave(fleet, tiny_exports):
    s, target, recorder, client = fleet
    old, new = _live(target), "wave-b"
    before = getattr(recorder.balancer, "crossings", 0)  # earlier tests share the recorder
    traffic = Episodes(str(client.base_url), "wave")
    traffic.wait_whole(old)  # episodes counted rather than timed, before the wave and after it
    ro = roll_out(s, target, tiny_exports["bf16"], new, PROMPTS)
    traffic.wait_whole(new)
    traffic.finish()
    assert not traffic.failures, traffic.failures[:5]
    assert ro.waves == 2 and _live(target) == new
    episodes = _versions_by_episode(recorder, "wave-")
    crossed = {t: v for t, v in episodes.items() if len(set(v)) > 1}
    # an episode changes version at most once, old to new, and only when no old replica was left:
    # at that moment each worker had at most one episode in flight
    assert all(v == sorted(v, key=[old, new].index) for v in crossed.values()), crossed
    assert len(crossed) <= 3, crossed
    assert recorder.balancer.crossings - before == len(crossed)
    whole = {v[0] for v in episodes.values() if len(set(v)) == 1}
    assert whole == {old, new}, episodes  # both versions served whole episodes while the fleet was mixed


def test_a_clients_policy_version_header_never_files_a_call_under_another_version(fleet):
    """Following a deployment, the version that answered is what a call is filed under: a tenant
    claiming the canary's (or any) version in ``X-Policy-Version`` is counted, not believed."""
    s, target, recorder, client = fleet
    live = _live(target)
    before = client.get("/stats").json()["counters"].get("policy_version_header_ignored", 0)
    for i, claim in enumerate(["can-1", "round-999999", live]):
        r = client.post("/v1/completions", json={"model": "any", "prompt": PROMPTS[0], "max_tokens": 2},
                        headers={"X-Trajectory-Id": f"claims-{i}", "X-Policy-Version": claim})
        assert r.status_code == 200, r.text
    assert _versions_by_episode(recorder, "claims-") == {f"claims-{i}": [live] for i in range(3)}
    counters = client.get("/stats").json()["counters"]
    assert counters.get("policy_version_header_ignored", 0) - before == 2, counters


def _canary(s, target, export):
    """The canary ``can-1`` on half of the trajectories beside the fleet (started when none runs)."""
    ep = endpoint_file(s.home_path).read()
    if ep.canary is None or ep.canary_paused():
        target.stop_canary()
        start_canary(s, target, export, "can-1", PROMPTS, fraction=0.5)
    return target.canary()


@pytest.mark.long(seconds=30)
def test_an_episode_that_started_before_the_canary_stays_on_the_stable_version(fleet, tiny_exports):
    s, target, recorder, client = fleet
    target.stop_canary()
    stable = _live(target)
    inside = [t for t in (f"early-{i}" for i in range(40)) if canary_share(t) < 0.5][:4]
    assert [_call(client, t) for t in inside] == [stable] * 4  # call 0, before the canary
    _canary(s, target, tiny_exports["bf16"])
    assert [_call(client, t, 1) for t in inside] == [stable] * 4  # call 1: never switched to the canary
    fresh = [t for t in (f"fresh-{i}" for i in range(40)) if canary_share(t) < 0.5][:4]
    assert [_call(client, t) for t in fresh] == ["can-1"] * 4


@pytest.mark.long(seconds=40)
def test_a_crashed_canary_fails_no_call_is_paused_with_the_reason_and_resumed_when_back(fleet, tiny_exports):
    s, target, recorder, client = fleet
    stable = _live(target)
    server = _canary(s, target, tiny_exports["bf16"])
    inside = [t for t in (f"crash-{i}" for i in range(60)) if canary_share(t) < 0.5]
    assert [_call(client, t) for t in inside[:3]] == ["can-1"] * 3
    os.killpg(server.pid, signal.SIGKILL)  # the canary's server dies mid-episode
    # every later call succeeds: the episodes cross to the stable version, new ones start there
    assert [_call(client, t, 1) for t in inside[:3]] == [stable] * 3
    assert [_call(client, t) for t in inside[3:8]] == [stable] * 5
    deadline = time.monotonic() + 120  # the health loop's refusals complete the count (a ceiling)
    while endpoint_file(s.home_path).read().canary_paused() is None:
        assert time.monotonic() < deadline, "the crashed canary was never paused"
        time.sleep(0.2)
    reason = endpoint_file(s.home_path).read().canary_paused()
    assert "could not be connected to" in reason and "can-1" in reason, reason
    stats = client.get("/stats").json()
    assert stats["counters"].get("canary_paused") == 1, stats["counters"]
    assert _versions_by_episode(recorder, "crash-")[inside[0]] == ["can-1", stable]
    # its server comes back at the same address (as Ray's actor brings it back): the recorder resumes it
    back = target.start(tiny_exports["bf16"], "can-1", server.port, slot=target.CANARY)
    try:
        deadline = time.monotonic() + 300
        while endpoint_file(s.home_path).read().canary_paused() is not None:
            assert time.monotonic() < deadline, "the canary that answers again was never resumed"
            time.sleep(0.2)
        # the recorder counts a resume once its write of the endpoint file returned: a moment after it
        until("the resume counted", lambda: client.get("/stats").json()["counters"].get("canary_resumed"), 60)
        assert client.get("/stats").json()["counters"].get("canary_resumed") == 1
        assert len(endpoint_file(s.home_path).read().canary["pauses"]) == 1
        fresh = [t for t in (f"back-{i}" for i in range(60)) if canary_share(t) < 0.5][:3]
        assert [_call(client, t) for t in fresh] == ["can-1"] * 3
    finally:
        os.killpg(back.pid, signal.SIGKILL)
    target.stop_canary()
    assert endpoint_file(s.home_path).read().canary is None and not server.alive()


def _wide(s, **deploy):
    """The same fleet's settings, a wave being both replicas at once."""
    return s.model_copy(update={"deploy": s.deploy.model_copy(update={"max_unavailable": 2, **deploy})})


@pytest.mark.long(seconds=40)
def test_every_new_server_of_a_wave_is_probed(fleet, tiny_exports):
    """Replica 1's new server serves W4A4 weights under the bf16 name: a wave of both replicas is
    refused on it, though replica 0's new server is right."""
    s, target, _, _ = fleet
    wide = _wide(s, probe_mean_bound=1e-4)
    before = [(r.pid, r.policy_version) for r in target.currents()]

    class BrokenSecondReplica(ProdrlServeTarget):
        def command(self, export_dir, port, policy_version):
            broken = port in self._ports(1)
            return super().command(tiny_exports["nvfp4-w4a4"] if broken else export_dir, port, policy_version)

    with pytest.raises(DeployRejected) as err:
        roll_out(wide, BrokenSecondReplica(wide, s.home_path), tiny_exports["bf16"], "wide-bad", PROMPTS)
    e = err.value
    assert "parity probe failed on replica 1" in e.reason, e.reason
    assert [(r.pid, r.policy_version) for r in target.currents()] == before
    assert not any(record_alive(x) for x in e.switch.detail["slots"])
    ep = endpoint_file(s.home_path).read()
    assert [r["policy_version"] for r in ep.replica_list()] == [v for _, v in before]


@pytest.mark.long(seconds=40)
def test_a_commit_that_fails_half_way_restores_the_previous_servers(fleet, tiny_exports):
    """The endpoint file cannot be written once (a full disk): both slots were already made current,
    so the rollback makes the previous servers current again and stops the new ones."""
    s, target, _, client = fleet
    wide = _wide(s)
    before = [(r.pid, r.policy_version) for r in target.currents()]

    class DiskFullOnce(ProdrlServeTarget):
        failed = False

        def write_endpoint(self, policy_version, export_dir):
            if not DiskFullOnce.failed:
                DiskFullOnce.failed = True
                raise OSError(28, "No space left on device")
            super().write_endpoint(policy_version, export_dir)

    with pytest.raises(DeployRejected) as err:
        roll_out(wide, DiskFullOnce(wide, s.home_path), tiny_exports["bf16"], "wide-commit", PROMPTS)
    e = err.value
    assert "commit failed: OSError" in e.reason and "No space left" in e.reason, e.reason
    assert [(r.pid, r.policy_version) for r in target.currents()] == before
    assert not any(record_alive(x) for x in e.switch.detail["slots"])
    ep = endpoint_file(s.home_path).read()
    assert [r["policy_version"] for r in ep.replica_list()] == [v for _, v in before]
    assert _call(client, "after-commit-failure") == before[0][1]


@pytest.mark.long(seconds=15)
def test_a_canary_that_cannot_be_routed_to_is_stopped(tiny_exports, tmp_path):
    """No live deployment beside it (no endpoint file): the probed canary cannot be committed; its
    server is stopped and the deploy is rejected, as any other failure."""
    s = Settings(home=str(tmp_path / "home"), deploy={
        "target": "prodrl-serve", "target_port": pick_port_range(4), "replicas": 1, "probe_prompts": 2,
        "max_tokens": 4, "export_scheme": "bf16"})
    target = make_target(s)
    try:
        with pytest.raises(DeployRejected) as err:
            start_canary(s, target, tiny_exports["bf16"], "lonely", PROMPTS, fraction=0.5)
        assert "canary commit failed" in err.value.reason and "no endpoint file" in err.value.reason, err.value.reason
        assert target.canary() is None and not record_alive(err.value.switch.detail)
        assert endpoint_file(s.home_path).read() is None
    finally:
        target.stop()
