"""The recorder's probes: ``/health/live`` and ``/health/ready`` answer a kubelet without a token or a
rate limit; readiness is false, saying why, when records cannot reach the store, when no replica of
the followed deployment answers, or before any deployment exists. ``/health`` keeps its token."""

from __future__ import annotations

import json
import os
import shutil
import time

import httpx

from prodrl_pipelines.deploy_targets.base import Endpoint, EndpointFile
from tests.test_recorder import fake, serving, start_recorder  # noqa: F401 - fixtures

TOKEN = "probe-tenant-token-0123456789"
BODY = {"prompt": [5, 6, 7], "max_tokens": 3}


def _tokens(tmp_path, rate=None):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tenants": {"t": {"tokens": [TOKEN], **({"requests_per_s": rate} if rate else {})}}}))
    return path


def _until(cond, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (v := cond()):
        assert time.monotonic() < deadline, "not within the ceiling"
        time.sleep(0.1)
    return v


def test_probes_need_no_token_and_no_rate_limit_and_say_what_is_ready(fake, start_recorder, tmp_path):
    r = start_recorder(fake.url, tokens_file=str(_tokens(tmp_path, rate=0.01)), tokenizer_dir=None)
    with httpx.Client(base_url=r.srv.url, timeout=60) as anon:
        assert anon.get("/health").status_code == 401  # as before: behind the token
        for _ in range(5):  # far past the tenant's rate, and without its token
            assert anon.get("/health/live").json() == {"status": "live"}
            ready = anon.get("/health/ready")
            assert ready.status_code == 200, ready.text
        checks = ready.json()["checks"]
        assert ready.json()["ready"] is True and set(checks) == {"wal", "store"}  # no upstream check: a fixed upstream
        assert anon.post("/v1/completions", json=BODY).status_code == 401  # the API is not opened


def test_not_ready_while_records_cannot_reach_the_store_then_ready_again(fake, start_recorder, tmp_path):
    store = tmp_path / "store"
    r = start_recorder(fake.url, store_dir=store, tokens_file=str(_tokens(tmp_path)), tokenizer_dir=None,
                       flush_interval_s=0.2)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(r.srv.url + "/v1/completions", json=BODY, headers=auth, timeout=60).status_code == 200
    assert r.rec.ingestor.flush(60)
    moved = tmp_path / "tables-away"
    shutil.move(store / "tables", moved)
    (store / "tables").write_text("not a directory")  # every write to the store fails now
    assert httpx.post(r.srv.url + "/v1/completions", json=BODY, headers=auth, timeout=60).status_code == 200
    not_ready = _until(lambda: (resp := httpx.get(r.srv.url + "/health/ready", timeout=60)).status_code == 503 and resp)
    store_check = not_ready.json()["checks"]["store"]
    assert store_check["ok"] is False and "flushes to the store failing" in store_check["detail"], store_check
    os.remove(store / "tables")
    shutil.move(moved, store / "tables")
    _until(lambda: httpx.get(r.srv.url + "/health/ready", timeout=60).status_code == 200)
    assert r.store().read_calls().num_rows == 2  # the acknowledged call waited in the WAL, then landed


def test_following_a_deployment_ready_only_while_a_replica_answers(fake, start_recorder, tmp_path):
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    # the replica answers its health check, as prodrl serve and vLLM do (the recorder's health loop
    # asks each second), 503 while the test says it is sick
    sick = []
    fake.app.router.routes.append(Route("/health", lambda request: JSONResponse({}, status_code=503 if sick else 200),
                                        methods=["GET"]))
    ep_file = tmp_path / "endpoint.json"
    r = start_recorder("", follow=str(ep_file), tokens_file=str(_tokens(tmp_path)), tokenizer_dir=None)

    def ready():
        resp = httpx.get(r.srv.url + "/health/ready", timeout=60)
        return resp.status_code, resp.json()["checks"]["upstream"]["detail"]

    assert ready() == (503, "no deployment yet (bootstrap first)")
    EndpointFile(ep_file).write(Endpoint(fake.url, "fake-v3", "v3", replicas=[
        {"url": fake.url, "served_model_name": "fake-v3", "policy_version": "v3"}]))
    assert _until(lambda: (v := ready())[0] == 200 and v) == (200, "1 of 1 replicas up")
    sick.append(True)  # the health loop takes it out
    assert _until(lambda: (v := ready())[0] == 503 and v) == (503, "0 of 1 replicas up")
    sick.clear()  # ... and brings it back
    assert _until(lambda: (v := ready())[0] == 200 and v) == (200, "1 of 1 replicas up")
