"""The recorder's Prometheus ``/metrics`` and its request log, through a real recorder and upstreams:
what is counted, timed and logged for each call, that a scrape needs no token, and that no series
or log line carries a trajectory id's label or a call's text."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prodrl_pipelines.recorder.metrics import counter_families
from tests.test_recorder import AUTH, PROMPT, FakeUpstream, serving, start_recorder, upstream  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fake():
    yield from serving(FakeUpstream())


LOG_FIELDS = {"ts", "level", "service", "event", "method", "route", "status", "tenant", "trajectory_id", "version",
              "replica", "streamed", "duration_ms", "upstream_ms", "added_ms", "prompt_tokens", "completion_tokens"}

BOUNDED_LABELS = {"route", "code", "tenant", "version", "replica", "group", "reason", "part", "check", "state", "le"}


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """``/metrics`` without a token: sample name -> {sorted labels: value}."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(samples: dict, name: str, **labels) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def test_calls_are_counted_timed_and_split_into_upstream_and_the_recorders_own_share(fake, start_recorder):
    r = start_recorder(fake.url, tokenizer_dir=None, policy_version="v7")
    fake.delay = 0.3  # the upstream's share: never counted as the recorder's
    for i in range(3):
        assert r.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                           headers={"X-Trajectory-Id": f"traj-secret-{i}"}).status_code == 200
    fake.delay = 0.0
    assert httpx.post(r.srv.url + "/v1/completions", json={}, timeout=30).status_code == 401
    m = scrape(r.srv.url)
    route = "/v1/completions"
    assert one(m, "prodrl_recorder_request_duration_seconds_count", route=route) == 3
    assert one(m, "prodrl_recorder_added_latency_seconds_count", route=route) == 3
    assert one(m, "prodrl_recorder_upstream_duration_seconds_count", replica="upstream") == 3
    up = one(m, "prodrl_recorder_upstream_duration_seconds_sum", replica="upstream")
    total = one(m, "prodrl_recorder_request_duration_seconds_sum", route=route)
    added = one(m, "prodrl_recorder_added_latency_seconds_sum", route=route)
    assert up >= 3 * 0.3  # the upstream span covers the upstream's wait
    assert added >= 0 and added == pytest.approx(total - up, abs=1e-6)
    # the 401 was answered before any upstream: counted by route and code, not timed as a call
    assert one(m, "prodrl_recorder_responses_total", route=route, code="200") == 3
    assert one(m, "prodrl_recorder_responses_total", route=route, code="401") == 1
    assert one(m, "prodrl_recorder_unauthorized_total") == 1
    # Stats counters, with _total, per version and per tenant
    s = r.stats()
    assert one(m, "prodrl_recorder_requests_total") == s["requests"] == 3
    assert one(m, "prodrl_recorder_recorded_calls_by_version_total", version="v7") == 3
    # every recorded entry waited for its group's fsync: one observation each
    assert one(m, "prodrl_recorder_wal_entry_wait_seconds_count") == s["wal_appends"] >= 3
    assert one(m, "prodrl_recorder_wal_append_seconds_count") == s["wal_fsyncs"] >= 1
    assert one(m, "prodrl_recorder_ready") == 1 and one(m, "prodrl_recorder_ready_check", check="wal") == 1
    assert one(m, "prodrl_recorder_canary_state", state="none") == 1
    # bounded labels only: no series is keyed by a trajectory
    assert {k for series in m.values() for labels in series for k, _ in labels} <= BOUNDED_LABELS
    assert "traj-secret" not in httpx.get(r.srv.url + "/metrics").text


def test_in_flight_counts_calls_waiting_on_the_upstream(fake, start_recorder):
    r = start_recorder(fake.url, tokenizer_dir=None)
    fake.delay = 600.0  # held until released
    done: list[int] = []

    def call(i: int) -> None:
        with httpx.Client(base_url=r.srv.url, headers=AUTH, timeout=120) as c:
            done.append(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                               headers={"X-Trajectory-Id": f"f{i}"}).status_code)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120  # a ceiling; the three calls reach the upstream at any speed
    while one(scrape(r.srv.url), "prodrl_recorder_requests_in_flight") < 3:
        assert time.monotonic() < deadline, "three calls never in flight together"
        time.sleep(0.05)
    fake.delay = 0.0
    for t in threads:
        t.join(120)
    assert done == [200, 200, 200]
    m = scrape(r.srv.url)  # the scrapes themselves are not calls in flight
    assert one(m, "prodrl_recorder_requests_in_flight") == 0


def test_streamed_calls_are_timed_to_their_last_chunk_and_logged_without_text(upstream, start_recorder, tmp_path):  # noqa: F811
    log = tmp_path / "requests.jsonl"
    r = start_recorder(upstream.url, request_log=str(log))
    body = {"prompt": PROMPT, "max_tokens": 6, "seed": 3}
    plain = r.http.post("/v1/completions", json=body, headers={"X-Trajectory-Id": "a"})
    with r.http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers={"X-Trajectory-Id": "b"}) as s:
        streamed_text = "".join(s.iter_text())
    assert plain.status_code == 200 and "[DONE]" in streamed_text
    assert r.http.post("/v1/feedback", json={"trajectory_id": "a", "reward": 1.0}).status_code == 200
    assert httpx.get(r.srv.url + "/health/ready").status_code == 200  # a probe: not logged
    m = scrape(r.srv.url)
    assert one(m, "prodrl_recorder_upstream_duration_seconds_count", replica="upstream") == 2
    assert one(m, "prodrl_recorder_request_duration_seconds_count", route="/v1/feedback") == 1

    lines = [json.loads(x) for x in log.read_text().splitlines()]  # line-buffered: there already
    assert [(x["route"], x["status"], x["trajectory_id"], x["streamed"]) for x in lines] == [
        ("/v1/completions", 200, "a", False), ("/v1/completions", 200, "b", True), ("/v1/feedback", 200, None, False)]
    rows = {x["trajectory_id"]: x for x in r.store().read_calls().to_pylist()}
    for x in lines[:2]:
        row = rows[x["trajectory_id"]]
        assert x["version"] == row["policy_version"] == "v0" and x["tenant"] == "default"
        assert x["prompt_tokens"] == len(row["prompt_token_ids"]) and x["completion_tokens"] == len(row["output_token_ids"])
        assert x["duration_ms"] >= x["upstream_ms"] > 0 and x["added_ms"] == pytest.approx(
            x["duration_ms"] - x["upstream_ms"], abs=0.01)
        assert x["service"] == "recorder" and x["event"] == "request" and x["replica"] is None
        assert set(x) == LOG_FIELDS  # no prompt, no output: nothing else is written
    assert lines[2]["upstream_ms"] is None and lines[2]["version"] is None


def test_counter_names_follow_prometheus_conventions():
    fams = {f.name: f for f in counter_families({
        "requests": 5, "tenant.alice.requests": 3, "tenant.bob.requests": 2, "recorded_calls": 4,
        "recorded_calls.version.v1": 1, "recorded_calls.version.v2": 3, "extend_skipped.no_tokenizer": 2,
        "unrecordable_calls": 1, "unrecordable.n>1": 1, "time_us.upstream": 900})}
    assert set(fams) == {"prodrl_recorder_requests", "prodrl_recorder_tenant_requests", "prodrl_recorder_recorded_calls",
                         "prodrl_recorder_recorded_calls_by_version", "prodrl_recorder_extend_skipped",
                         "prodrl_recorder_unrecordable_calls", "prodrl_recorder_unrecordable", "prodrl_recorder_time_us"}

    def samples(name):
        return {(s.name, tuple(s.labels.items())): s.value for s in fams[name].samples}

    assert samples("prodrl_recorder_requests") == {("prodrl_recorder_requests_total", ()): 5}
    assert samples("prodrl_recorder_tenant_requests") == {
        ("prodrl_recorder_tenant_requests_total", (("tenant", "alice"),)): 3,
        ("prodrl_recorder_tenant_requests_total", (("tenant", "bob"),)): 2}
    assert samples("prodrl_recorder_recorded_calls_by_version") == {
        ("prodrl_recorder_recorded_calls_by_version_total", (("version", "v1"),)): 1,
        ("prodrl_recorder_recorded_calls_by_version_total", (("version", "v2"),)): 3}
    assert samples("prodrl_recorder_unrecordable") == {("prodrl_recorder_unrecordable_total", (("reason", "n>1"),)): 1}
    assert samples("prodrl_recorder_time_us") == {("prodrl_recorder_time_us_total", (("part", "upstream"),)): 900}
    # a dotted counter whose plain twin exists keeps the plain name for the twin
    both = {f.name for f in counter_families({"extend_rendered": 2, "extend_rendered.history_changed": 1})}
    assert both == {"prodrl_recorder_extend_rendered", "prodrl_recorder_extend_rendered_by_reason"}


def test_json_log_lines_have_the_request_logs_shape():
    import subprocess
    import sys

    code = ("import logging, logging.config; from prodrl_pipelines.observability.json_logs import log_config\n"
            "logging.config.dictConfig(log_config('recorder'))\n"
            "logging.getLogger('uvicorn.error').warning('Started server process [%d]', 42)\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    logging.getLogger('prodrl').exception('flush failed')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = [json.loads(x) for x in out.stderr.splitlines()]
    assert [(x["level"], x["service"], x["logger"], x["event"]) for x in lines] == [
        ("warning", "recorder", "uvicorn.error", "Started server process [42]"), ("error", "recorder", "prodrl", "flush failed")]
    assert "ZeroDivisionError" in lines[1]["error"] and lines[0]["ts"].endswith("+00:00")


def test_without_request_metrics_only_the_scrape_time_series_remain(fake, start_recorder):
    r = start_recorder(fake.url, tokenizer_dir=None, request_metrics=False)
    assert r.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    m = scrape(r.srv.url)
    assert one(m, "prodrl_recorder_requests_total") == 1 and one(m, "prodrl_recorder_requests_in_flight") == 0
    assert not m.get("prodrl_recorder_request_duration_seconds_count") and not m.get("prodrl_recorder_responses_total")
