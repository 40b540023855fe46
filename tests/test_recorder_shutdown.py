"""``prodrl record`` stopped by SIGTERM or SIGINT: the recorder flushes what it acknowledged into the
store and the process exits 0 (uvicorn alone re-raises the signal: exit status -15); a flush that
cannot finish leaves its write-ahead log segments for the next start, and says so."""

from __future__ import annotations

import signal
import subprocess

import httpx
import pytest

from prodrl_pipelines.recorder.ingest import Ingestor
from prodrl_pipelines.recorder.wal import WriteAheadLog
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore
from tests.test_recorder import AUTH, _call_row, _free_port, _spawn_recorder, fake  # noqa: F401 - fixtures


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_a_clean_exit_0_after_the_flush(fake, tmp_path, sig):
    store_dir, port = tmp_path / "store", _free_port()
    # nothing is flushed while it runs: every row is in the write-ahead log when the signal comes
    proc = _spawn_recorder(fake.url, store_dir, port, "--flush-rows", "100000", "--flush-interval", "3600")
    try:
        acked = set()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30) as c:
            for i in range(6):
                resp = c.post("/v1/completions", json={"prompt": [1, i], "max_tokens": 2},
                              headers={"X-Session-Id": f"run-{i % 2}"})
                assert resp.status_code == 200 and resp.headers["x-prodrl-recorded"] == "true"
                acked.add((resp.headers["x-trajectory-id"], int(resp.headers["x-call-index"])))
            assert c.get("/stats").json()["counters"].get("flushed_calls", 0) == 0
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    calls = TrajectoryStore(LocalBlobStore(store_dir)).read_calls(columns=["trajectory_id", "call_index"])
    assert set(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist())) == acked
    assert WriteAheadLog(store_dir / "_recorder" / "wal").segments() == []


def test_a_flush_that_cannot_finish_reports_the_segments_it_leaves(tmp_path, monkeypatch):
    """What ``prodrl record`` exits 1 on: ``Ingestor.stop`` counts the segments still holding entries."""
    store = TrajectoryStore(LocalBlobStore(tmp_path / "store"))

    def broken(*a, **k):
        raise OSError("the store is down")

    monkeypatch.setattr(store, "write_calls", broken)
    ing = Ingestor(store, tmp_path / "wal", flush_rows=10_000, flush_interval_s=3600)
    ing.start()
    row = {k: v for k, v in _call_row("c", 0).items() if k not in ("trajectory_id", "call_index", "created_at")}
    ing.commit_call("c", row)[1].result(10)
    assert ing.stop(timeout=0.5) == 1
    assert len(WriteAheadLog(tmp_path / "wal").segments()) == 1  # replayed at the next start
    clean = Ingestor(TrajectoryStore(LocalBlobStore(tmp_path / "store")), tmp_path / "wal", flush_rows=10_000,
                     flush_interval_s=3600)
    clean.start()
    assert clean.stop() == 0 and clean.store.read_calls().num_rows == 1


def test_the_recorder_cli_exits_0_on_sigterm_while_it_is_idle(fake, tmp_path):
    proc = _spawn_recorder(fake.url, tmp_path / "store", _free_port())
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0
