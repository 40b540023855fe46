"""The recorder at 256 concurrent clients: `prodrl record` -> `prodrl serve` as real processes.

Before the fix, 128-256 concurrent clients saw "Connection reset by peer" / "Server disconnected"
(client -> recorder) and 502s (recorder -> serve) a few times per thousand calls: both servers closed
keep-alive connections after uvicorn's default 5 s while clients still reused them (httpx reuses for
5 s, aiohttp for 15 s, and the recorder's own upstream pool for 30 s, longest-idle first). Here two
waves of 256 concurrent calls are separated by an idle pause just under 5 s, which put every
connection of both hops right at that expiry.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import httpx

from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore
from tests.helpers import wait_healthy

TOKEN = "conc-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [1, 116, 5, 24, 17, 25, 35, 2, 5, 1, 121, 5]
REPO = Path(__file__).resolve().parents[1]
CONCURRENCY = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], port: int, headers: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PRODRL_RECORDER_TOKEN": TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "prodrl_pipelines.cli", *args, "--port", str(port)], env=env,
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return wait_healthy(proc, f"http://127.0.0.1:{port}/health", headers, 120, args[0])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _waves(url: str, waves: int, pause_s: float) -> list[tuple[str, object, str | None]]:
    """``waves`` bursts of CONCURRENCY calls (one per trajectory) on one keep-alive pool (aiohttp
    defaults: connections reused for 15 s), ``pause_s`` idle between them."""
    out: list[tuple[str, object, str | None]] = []
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(url, headers=AUTH, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def one(tid: str):
            try:
                async with http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
                                     headers={"X-Trajectory-Id": tid}) as r:
                    await r.read()
                    return tid, r.status, r.headers.get("X-Call-Index")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return tid, f"{type(exc).__name__}: {exc}", None

        for w in range(waves):
            if w:
                await asyncio.sleep(pause_s)
            out += await asyncio.gather(*(one(f"w{w}-{i}") for i in range(CONCURRENCY)))
    return out


def test_256_concurrent_calls_all_succeed_and_are_recorded_once(model_dir, tmp_path):
    serve_port, rec_port = _free_port(), _free_port()
    store = tmp_path / "store"
    serve = _spawn(["serve", str(model_dir), "--served-model-name", "v0", "--threads", "1",
                    "--max-batch-size", str(CONCURRENCY)], serve_port)
    rec = None
    try:
        rec = _spawn(["record", "--upstream", f"http://127.0.0.1:{serve_port}", "--store", str(store),
                      "--flush-interval", "0.2"], rec_port, AUTH)
        results = asyncio.run(_waves(f"http://127.0.0.1:{rec_port}", waves=2, pause_s=4.9))
        failed = [r for r in results if r[1] != 200]
        assert not failed, f"{len(failed)} of {len(results)} calls failed, e.g. {failed[:3]}"
        assert all(index == "0" for _, _, index in results)
        counters = httpx.get(f"http://127.0.0.1:{rec_port}/stats", headers=AUTH, timeout=60).json()["counters"]
        assert counters["requests"] == counters["recorded_calls"] == len(results) == 2 * CONCURRENCY
        assert not {k: v for k, v in counters.items() if k.startswith(("upstream_", "unrecordable", "commit_"))
                    and k != "upstream_retries"}
    finally:
        if rec is not None:
            _stop(rec)  # flushes the WAL to Parquet
        _stop(serve)
    calls = TrajectoryStore(LocalBlobStore(store)).read_calls(dedupe=False, columns=["trajectory_id", "call_index"])
    got = Counter(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist()))
    assert got == Counter({(tid, 0): 1 for tid, _, _ in results})  # every call exactly once
