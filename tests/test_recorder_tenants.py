"""The recorder's tenants (tokens file, rotation, namespaces, counters, rate limit) and client retries
(an ``Idempotency-Key`` or the openai client's retry count replaces the earlier attempt)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace

import httpx
import openai
import pyarrow as pa
import pytest

from prodrl_pipelines.recorder.ingest import Ingestor
from prodrl_pipelines.recorder.service import RecorderConfig
from prodrl_pipelines.recorder.tenants import Tenants, TokensFileError
from prodrl_pipelines.recorder.wal import WriteAheadLog, encode_entry
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore
from tests.test_recorder import AUTH, REPO, _call_row, fake, serving, start_recorder  # noqa: F401 - fixtures

BODY = {"prompt": [5, 6, 7], "max_tokens": 3}
ALICE, ALICE_NEW, BOB, OPS = "alice-token-0123456789", "alice-token-rotated-99", "bob-token-0123456789ab", "ops-token-0123456789abc"


def _write_tokens(path, tenants: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"tenants": tenants}))
    os.replace(tmp, path)  # as an operator's editor or a secret mount does: a new file, atomically


def _client(r, token: str) -> httpx.Client:
    return httpx.Client(base_url=r.srv.url, timeout=30, headers={"Authorization": f"Bearer {token}"})


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.json"
    _write_tokens(path, {"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]},
                         "ops": {"tokens": [OPS], "admin": True}})
    return path


def test_tenants_own_their_trajectories_and_see_their_own_counters(fake, start_recorder, tokens):
    r = start_recorder(fake.url, tokens_file=str(tokens), tokenizer_dir=None)
    alice, bob, ops = _client(r, ALICE), _client(r, BOB), _client(r, OPS)
    a0 = alice.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "t1"})
    assert a0.status_code == 200 and a0.headers["x-trajectory-id"] == "t1" and a0.headers["x-call-index"] == "0"
    # the same id from another tenant is another trajectory: bob cannot append to alice's
    b0 = bob.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "t1"})
    assert b0.headers["x-call-index"] == "0"
    assert alice.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "t1"}).headers["x-call-index"] == "1"
    # ... nor post its reward: bob's "t1" is his own, and "alice/t1" names nothing he owns
    assert bob.post("/v1/feedback", json={"trajectory_id": "alice/t1", "reward": 9.0}).status_code == 404
    assert bob.post("/v1/feedback", json={"trajectory_id": "t1", "reward": -1.0}).status_code == 200
    fb = alice.post("/v1/feedback", json={"trajectory_id": "t1", "reward": 1.0})
    assert fb.status_code == 200 and fb.json()["trajectory_id"] == "t1"
    store = r.store()
    calls = store.read_calls().to_pylist()
    assert sorted((c["trajectory_id"], c["call_index"]) for c in calls) == [("alice/t1", 0), ("alice/t1", 1), ("bob/t1", 0)]
    rewards = {x["trajectory_id"]: x["reward"] for x in store.read_rewards().to_pylist()}
    assert rewards == {"alice/t1": 1.0, "bob/t1": -1.0}

    mine = bob.get("/stats").json()
    assert set(mine["tenants"]) == {"bob"} and mine["tenants"]["bob"]["recorded_calls"] == 1
    assert mine["tenants"]["bob"]["feedback_unknown_trajectory"] == 1
    everyone = ops.get("/stats")
    assert set(everyone.json()["tenants"]) == {"alice", "bob"}
    assert everyone.json()["tenants"]["alice"]["recorded_calls"] == 2
    metrics = ops.get("/metrics").text
    assert 'prodrl_recorder_tenant_recorded_calls_total{tenant="alice"} 2.0' in metrics
    for secret in (ALICE, BOB, OPS):
        assert secret not in everyone.text and secret not in metrics
    for c in (alice, bob, ops):
        c.close()


def test_tokens_rotate_without_a_restart_and_a_bad_edit_keeps_the_tokens_in_force(fake, start_recorder, tokens):
    r = start_recorder(fake.url, tokens_file=str(tokens), tokenizer_dir=None)
    old, new = _client(r, ALICE), _client(r, ALICE_NEW)
    assert old.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "t"}).status_code == 200
    assert new.get("/health").status_code == 401
    _write_tokens(tokens, {"alice": {"tokens": [ALICE, ALICE_NEW]}, "bob": {"tokens": [BOB]}})  # both, while clients move
    assert old.get("/health").status_code == 200 and new.get("/health").status_code == 200
    _write_tokens(tokens, {"alice": {"tokens": [ALICE_NEW]}, "bob": {"tokens": [BOB]}})  # the old one retired
    assert old.get("/health").status_code == 401
    # same tenant, same namespace: the new token continues alice's trajectory
    assert new.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "t"}).headers["x-call-index"] == "1"
    tokens.write_text('{"tenants": {"alice": {"tokens": ["short"]}}}')  # invalid: kept out, counted once
    assert new.get("/health").status_code == 200 and new.get("/health").status_code == 200
    assert new.get("/stats").json()["counters"]["tokens_file_errors"] == 1
    old.close()
    new.close()


def test_a_tenant_over_its_rate_limit_gets_a_429_with_retry_after(fake, start_recorder, tokens, monkeypatch):
    # the bucket's clock stands still unless the test moves it: the requests' own duration (long on a
    # loaded machine) refills nothing
    from prodrl_pipelines.recorder import tenants as tenants_module

    clock = [1000.0]
    monkeypatch.setattr(tenants_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    _write_tokens(tokens, {"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB], "requests_per_s": 2, "burst": 3}})
    r = start_recorder(fake.url, tokens_file=str(tokens), tokenizer_dir=None)
    bob, alice = _client(r, BOB), _client(r, ALICE)
    codes = [bob.post("/v1/completions", json=BODY).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]  # burst 3, then 2/s
    limited = bob.post("/v1/completions", json=BODY)
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert "over its rate limit of 2 requests/s" in limited.json()["error"]["message"]
    assert alice.post("/v1/completions", json=BODY).status_code == 200  # other tenants are not limited by bob
    clock[0] += 0.4
    assert bob.post("/v1/completions", json=BODY).status_code == 429  # 0.8 of a request refilled
    clock[0] += 0.2
    assert bob.post("/v1/completions", json=BODY).status_code == 200  # the bucket refills
    clock[0] += 0.6  # /stats is a request too
    assert bob.get("/stats").json()["tenants"]["bob"]["rate_limited"] == 4
    bob.close()
    alice.close()


@pytest.mark.parametrize("doc, fragment", [
    ("not json", "not JSON"),
    ('{"tenants": {}}', 'expected {"tenants"'),
    ('{"tenants": {"a b": {"tokens": ["0123456789abcdef"]}}}', "tenant 'a b': a tenant name is"),
    ('{"tenants": {"a.b": {"tokens": ["0123456789abcdef"]}}}', "tenant 'a.b': a tenant name is"),
    ('{"tenants": {"a": {"tokens": ["short"]}}}', "tenant 'a': `tokens` must be"),
    ('{"tenants": {"a": {"tokens": ["0123456789abcdef"], "rps": 3}}}', "unknown field(s) ['rps']"),
    ('{"tenants": {"a": {"tokens": ["0123456789abcdef"], "requests_per_s": -1}}}', "`requests_per_s` must be a positive"),
    ('{"tenants": {"a": {"tokens": ["0123456789abcdef"]}, "b": {"tokens": ["0123456789abcdef"]}}}', "listed twice"),
])
def test_a_bad_tokens_file_fails_the_start_naming_the_entry(tmp_path, doc, fragment):
    path = tmp_path / "tokens.json"
    path.write_text(doc)
    with pytest.raises(TokensFileError) as e:
        Tenants(tokens_file=path)
    assert str(path) in str(e.value) and fragment in str(e.value)
    assert "0123456789abcdef" not in str(e.value)
    with pytest.raises(ValueError, match="exactly one source of bearer tokens"):
        RecorderConfig(upstream="http://x", store_dir=str(tmp_path), token="t", tokens_file=str(path))


# ----------------------------------------------------------------------------- retries


def test_a_retry_of_the_same_call_replaces_it_instead_of_appending(fake, start_recorder):
    r = start_recorder(fake.url, tokenizer_dir=None)
    h = {"X-Trajectory-Id": "agent"}

    def call(body, **extra):
        resp = r.http.post("/v1/completions", json=body, headers={**h, **extra})
        assert resp.status_code == 200, resp.text
        return int(resp.headers["x-call-index"])

    # the openai client's retry count: a retry (> 0) of the same body is the same call
    assert call(BODY, **{"x-stainless-retry-count": "0"}) == 0
    assert call({**BODY, "seed": 1}, **{"x-stainless-retry-count": "1"}) == 1  # another body: not a retry
    assert call({**BODY, "seed": 1}, **{"x-stainless-retry-count": "2"}) == 1  # a retry of call 1
    assert call(BODY, **{"x-stainless-retry-count": "0"}) == 2  # the same body sent anew: a new call
    # an Idempotency-Key names the call whatever the body
    assert call({**BODY, "seed": 5}, **{"Idempotency-Key": "k-1"}) == 3
    assert call({**BODY, "seed": 6}, **{"Idempotency-Key": "k-1"}) == 3
    assert call({**BODY, "seed": 7}, **{"Idempotency-Key": "k-2"}) == 4
    # keys are per trajectory
    other = r.http.post("/v1/completions", json=BODY, headers={"X-Trajectory-Id": "other", "Idempotency-Key": "k-1"})
    assert other.headers["x-call-index"] == "0"
    for count in ("many", b"\xb9"):  # b"\xb9" is "¹" in latin-1: a digit to str.isdigit, not to int()
        bad = r.http.post("/v1/completions", json=BODY, headers={**h, "x-stainless-retry-count": count})
        assert bad.status_code == 400 and "x-stainless-retry-count" in bad.json()["error"]["message"]

    calls = r.store().read_calls().to_pylist()
    agent = sorted((c["call_index"], c["output_token_ids"]) for c in calls if c["trajectory_id"] == "agent")
    assert [i for i, _ in agent] == [0, 1, 2, 3, 4]  # one row per call: no phantom, no conflict
    seed6 = [(6 + 7 * t + 3) % 40 + 3 for t in range(3)]  # the fake upstream's answer to seed 6
    assert dict(agent)[3] == seed6  # the retry's answer is the call
    all_rows = r.rec.store.read_calls(dedupe=False, retracted=True)
    assert all_rows.num_rows == 8  # the superseded attempts stay in the store, retracted
    assert r.stats()["retried_calls"] == 2


def test_the_openai_clients_timeout_retries_add_no_phantom_calls(fake, start_recorder):
    """The reported case: one timed-out model call became calls 0, 1 and 2 of the trajectory."""
    r = start_recorder(fake.url, tokenizer_dir=None)
    # the timeout leaves each attempt time to reach the upstream on a loaded machine
    client = openai.OpenAI(base_url=r.srv.url + "/v1", api_key="rec-token", max_retries=2, timeout=3,
                           default_headers={"X-Trajectory-Id": "agent"})
    fake.delay = 300.0  # every attempt is held upstream until the client has given up on it
    try:
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=3)
    finally:
        fake.delay = 0.0
    deadline = time.monotonic() + 120  # the abandoned attempts' upstream answers come back and are dropped
    while r.stats().get("client_disconnected", 0) < 3:
        assert time.monotonic() < deadline, r.stats()
        time.sleep(0.1)
    done = client.with_options(timeout=60).completions.with_raw_response.create(model="m", prompt=[5, 6, 8],
                                                                                 max_tokens=3)
    assert done.headers["x-call-index"] == "0"  # the agent's real next turn is call 0, not call 3
    s = r.stats()
    assert s["client_disconnected"] == 3 and s["recorded_calls"] == 1
    assert [c["call_index"] for c in r.store().read_calls().to_pylist()] == [0]
    client.close()


def test_replay_of_a_retry_keeps_one_row_per_call(tmp_path):
    """A crash with both attempts still in the log: replay writes the retraction with the retry, and
    a second replay (a crash before the segments were deleted) changes nothing."""
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))
    first, retry = _call_row("a", 0), {**_call_row("a", 0), "output_token_ids": [9], "created_at": 1_800_000_000_000_000}
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    entries = [encode_entry({"kind": "call", "row": first}),
               encode_entry({"kind": "call", "row": retry, "supersedes": first["created_at"]}),
               encode_entry({"kind": "call", "row": _call_row("a", 1)})]
    wal.append(entries)
    wal.close()
    counts = Ingestor(store, tmp_path / "wal").recover()
    assert counts["replayed_calls"] == 3 and counts["replayed_retractions"] == 1
    rows = store.read_calls().to_pylist()
    assert [(x["call_index"], x["output_token_ids"]) for x in rows] == [(0, [9]), (1, [3])]
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    wal.append(entries)
    wal.close()
    again = Ingestor(store, tmp_path / "wal").recover()
    assert again["replay_duplicates"] == 3 and again.get("replayed_calls", 0) == 0
    assert store.read_calls(dedupe=False).num_rows == 2


def test_sigkill_with_retries_in_flight_and_during_replay_loses_nothing(fake, tmp_path):
    """kill -9 under load where every call is retried once (the openai client's retry count), then
    kill -9 again while the restarted recorder replays its log: afterwards every acknowledged call
    is in the store exactly once (one row per call id, the retry's), every reward once."""
    from tests.test_recorder import _free_port, _spawn_recorder, kill_under_load

    store_dir, port = tmp_path / "store", _free_port()
    proc = _spawn_recorder(fake.url, store_dir, port, "--flush-rows", "100000", "--flush-interval", "3600")
    acked: dict[tuple[str, int], list[int]] = {}  # call id -> the answer the client got last
    rewards: set[tuple[str, int]] = set()
    lock = threading.Lock()

    def client(w: int, stop: threading.Event) -> None:
        # a client that times out leaves the load for good: wait as long as a loaded machine may need
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=120) as c:
            i = 0
            while not stop.is_set():
                tid = f"w{w}-{i}"
                try:
                    for call in range(2):
                        body = {"prompt": [w, i, call], "max_tokens": 3, "seed": i}
                        for retry in range(2):  # the same call sent twice: the second is its retry
                            resp = c.post("/v1/completions", json=body,
                                          headers={"X-Trajectory-Id": tid, "x-stainless-retry-count": str(retry)})
                            if resp.status_code != 200:
                                return
                            with lock:
                                acked[(tid, int(resp.headers["x-call-index"]))] = resp.json()["choices"][0]["token_ids"] or []
                    fb = c.post("/v1/feedback", json={"trajectory_id": tid, "reward": 1.0})
                    if fb.status_code != 200:
                        return
                    with lock:
                        rewards.add((tid, fb.json()["created_at_us"]))
                except httpx.HTTPError:
                    return
                i += 1

    kill_under_load(proc, client, acked)
    assert len(acked) >= 150
    for delay in (1.0, 2.0, 3.0):  # before, during and after the replay of a log of every call
        env = {**os.environ, "PRODRL_RECORDER_TOKEN": "rec-token"}
        p = subprocess.Popen([sys.executable, "-m", "prodrl_pipelines.cli", "record", "--upstream", fake.url,
                              "--store", str(store_dir), "--port", str(port)], env=env, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.kill()
        p.wait(10)
    proc = _spawn_recorder(fake.url, store_dir, port)
    try:
        store = TrajectoryStore(LocalBlobStore(store_dir))
        calls = store.read_calls(dedupe=False)
        got = Counter(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist()))
        assert all(got[k] == 1 for k in acked) and max(got.values()) == 1
        assert store.read_calls(dedupe=False, retracted=True).num_rows >= calls.num_rows + 100  # the first attempts
        by_id = {(c["trajectory_id"], c["call_index"]): c["output_token_ids"] for c in calls.to_pylist()}
        assert all(by_id[k] == ids for k, ids in acked.items() if ids)  # the row is the answer the client kept
        r = store.read_rewards(latest=False)
        rc = Counter(zip(r.column("trajectory_id").to_pylist(), r.column("created_at").cast(pa.int64()).to_pylist()))
        assert all(rc[k] == 1 for k in rewards) and max(rc.values()) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_two_tenants_sessions_of_one_name_are_routed_apart(fake, start_recorder, tokens, tmp_path, monkeypatch):
    """Routing (the version pin, the replica pin) is keyed by the stored id, which is the tenant's:
    alice's session "same" and bob's are two sessions to the balancer, not one they push around."""
    from prodrl_pipelines.deploy_targets.base import Endpoint, EndpointFile
    from prodrl_pipelines.recorder.balancer import Balancer

    picked: list = []
    orig = Balancer.pick

    def spy(self, endpoint, trajectory_id, exclude=frozenset()):
        picked.append(trajectory_id)
        return orig(self, endpoint, trajectory_id, exclude)

    monkeypatch.setattr(Balancer, "pick", spy)
    ep_file = tmp_path / "endpoint.json"
    EndpointFile(ep_file).write(Endpoint(fake.url, "fake-v3", "v3", replicas=[
        {"url": fake.url, "served_model_name": "fake-v3", "policy_version": "v3"}]))
    r = start_recorder("", follow=str(ep_file), tokens_file=str(tokens), tokenizer_dir=None)
    for token in (ALICE, BOB):
        with _client(r, token) as c:
            resp = c.post("/v1/completions", json=BODY, headers={"X-Session-Id": "same"})
            assert resp.status_code == 200, resp.text
    assert [t for t in picked if t is not None] == ["alice/same", "bob/same"]  # None: the recorder's own calls
