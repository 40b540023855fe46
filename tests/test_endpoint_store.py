"""The endpoint record in PostgreSQL (``deploy_targets/endpoint_store.py``): what the deploy step, the
sensors, the fleet keeper and the recorder share when they run on hosts with no disk in common.
Writers on separate connections (threads, and another process) lose no update under random
interleavings; a row behaves as the file does (pausing and resuming a canary); a follower reads it
without blocking and keeps the last record while the database cannot be reached; a bad setting fails
naming it. A fleet deployed with its record in the database and followed by a recorder with no shared
home is in test_fleet.py."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO
from prodrl_pipelines.config.settings import Settings
from prodrl_pipelines.deploy_targets.base import Endpoint, EndpointFile
from prodrl_pipelines.deploy_targets.endpoint_store import PostgresEndpoint, endpoint_file, endpoint_location, open_endpoint
from prodrl_pipelines.recorder.upstream_view import FollowedEndpoint
from tests.helpers import until


def _ep(version: str = "v1", **kw) -> Endpoint:
    return Endpoint("http://10.0.0.1:8000", version, version, "prodrl-serve", **kw)


def _append(where: str, item: str, rng: random.Random | None = None) -> None:
    def change(ep):
        ep = ep or _ep()
        if rng is not None:
            time.sleep(rng.random() * 0.01)  # widen the read-modify-write window
        ep.replicas = [*ep.replicas, {"url": item, "served_model_name": "v1", "policy_version": "v1"}]
        return ep

    open_endpoint(where).update(change)


CHILD = """
import sys
from prodrl_pipelines.deploy_targets.base import Endpoint
from prodrl_pipelines.deploy_targets.endpoint_store import open_endpoint

def change(ep, item):
    ep = ep or Endpoint("http://10.0.0.1:8000", "v1", "v1", "prodrl-serve")
    ep.replicas = [*ep.replicas, {"url": item, "served_model_name": "v1", "policy_version": "v1"}]
    return ep

for i in range(8):
    open_endpoint(sys.argv[1]).update(lambda ep: change(ep, f"proc-{i}"))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_writers_on_separate_connections_lose_no_update(pg_url, seed):
    """Four threads and a second process append to one record, each change a read-modify-write with
    a random pause inside it: every append is there once, and the version counts every write."""
    where = f"{pg_url}#fleet-{seed}"
    rng = random.Random(seed)
    child = subprocess.Popen([sys.executable, "-c", CHILD, where], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    errors = []

    def writer(t: int, r: random.Random) -> None:
        try:
            for i in range(8):
                _append(where, f"thread{t}-{i}", r)
        except Exception as e:  # noqa: BLE001 - asserted below (the first writers once raced on CREATE TABLE)
            errors.append(repr(e))

    threads = [threading.Thread(target=writer, args=(t, random.Random(rng.random()))) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert child.wait(120) == 0 and not errors, errors
    version, ep = PostgresEndpoint(*where.rsplit("#", 1)).read_versioned()
    urls = [r["url"] for r in ep.replicas]
    expected = {f"thread{t}-{i}" for t in range(4) for i in range(8)} | {f"proc-{i}" for i in range(8)}
    assert sorted(urls) == sorted(expected) and version == len(expected)
    # each writer's own appends in its order
    assert [u for u in urls if u.startswith("proc-")] == [f"proc-{i}" for i in range(8)]


@pytest.mark.parametrize("backend", ["file", "postgresql"])
def test_a_row_and_a_file_pause_and_resume_a_canary_alike(pg_url, tmp_path, backend):
    settings = Settings(home=str(tmp_path / "home"),
                        deploy={"endpoint_store": pg_url if backend == "postgresql" else "", "endpoint_name": "a"})
    rec = endpoint_file(settings.home_path, settings.deploy)
    assert isinstance(rec, PostgresEndpoint) == (backend == "postgresql")
    assert rec.read() is None
    canary = {"policy_version": "v2", "fraction": 0.1, "replicas": [{"url": "http://c:1", "served_model_name": "v2",
                                                                      "policy_version": "v2"}]}
    rec.write(_ep(canary=canary))
    again = open_endpoint(endpoint_location(settings.home_path, settings.deploy))  # as another host opens it
    assert again.read().canary["policy_version"] == "v2" and again.read().switched_at
    assert again.pause_canary("http://c:1", "v2", "refused 3 connections")
    assert not rec.pause_canary("http://c:1", "v2", "again")  # already paused
    assert rec.read().canary_paused() == "refused 3 connections"
    assert not rec.resume_canary("http://c:1", "v1")  # not that canary
    assert rec.resume_canary("http://c:1", "v2") and rec.read().canary_paused() is None
    assert [p["reason"] for p in rec.read().canary["pauses"]] == ["refused 3 connections"]
    assert (tmp_path / "home" / "deployment" / "endpoint.json").exists() == (backend == "file")


def test_a_follower_reads_a_row_without_waiting_and_keeps_it_while_the_database_is_away(pg_url):
    where = f"{pg_url}#followed"
    follower = FollowedEndpoint(where, poll_s=0.05)
    try:
        assert follower.current() is None and not follower.error  # nothing deployed yet
        open_endpoint(where).write(_ep("v1"))
        until("v1 followed", lambda: (follower.current() or _ep("none")).policy_version == "v1", 60, every_s=0.02)
        open_endpoint(where).update(lambda ep: _ep("v2"))
        until("v2 followed", lambda: follower.current().policy_version == "v2", 60, every_s=0.02)
    finally:
        follower.close()
    # a database that cannot be reached (a port nothing listens on): no exception, the reason kept
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    away = FollowedEndpoint(f"postgresql://postgres@127.0.0.1:{port}/test#x", poll_s=60)
    try:
        assert away.current() is None and "OperationalError" in away.error
        away._ep = _ep("v7")  # what it had read before the database went away
        away._poll_once()
        assert away.current().policy_version == "v7" and away.error
    finally:
        away.close()


def test_bad_endpoint_settings_fail_naming_them(tmp_path):
    with pytest.raises(ValueError, match="deploy.endpoint_store='mysql://db/x'"):
        Settings(home=str(tmp_path), deploy={"endpoint_store": "mysql://db/x"})
    with pytest.raises(ValueError, match="deploy.endpoint_name='a b'"):
        Settings(home=str(tmp_path), deploy={"endpoint_store": "postgresql://db/x", "endpoint_name": "a b"})
    with pytest.raises(ValueError, match="URL#NAME"):
        open_endpoint("postgresql://db/x")
    assert isinstance(open_endpoint(tmp_path / "endpoint.json"), EndpointFile)
