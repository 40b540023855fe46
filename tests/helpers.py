"""Small builders of contract-conforming rows for tests (seeded, deterministic)."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

VOCAB = 50
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def make_call(
    trajectory_id: str,
    call_index: int = 0,
    *,
    policy_version: str = "v0",
    n_tokens: int = 4,
    k: int = 3,
    vocab: int = VOCAB,
    seed: int = 0,
    created_at: datetime | None = None,
    **overrides,
) -> dict:
    """One valid call row (CALL_SCHEMA); ``overrides`` replace fields after generation."""
    rng = np.random.default_rng([seed, call_index, sum(map(ord, trajectory_id))])
    out = rng.integers(0, vocab, n_tokens).tolist()
    top_ids = [rng.choice(vocab, size=k, replace=False).tolist() for _ in range(n_tokens)]
    top_lps = [sorted((-rng.random(k) * 5).tolist(), reverse=True) for _ in range(n_tokens)]
    row = {
        "trajectory_id": trajectory_id,
        "call_index": call_index,
        "task_id": f"task-{trajectory_id}",
        "policy_version": policy_version,
        "prompt_token_ids": rng.integers(0, vocab, 5).tolist(),
        "output_token_ids": out,
        "output_logprobs": (-rng.random(n_tokens) * 3).tolist(),
        "top_token_ids": top_ids,
        "top_logprobs": top_lps,
        "support_complete": False,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "prompt_text": "p",
        "output_text": "o",
        "created_at": created_at or T0,
    }
    row.update(overrides)
    return row


def make_trajectory(trajectory_id: str, n_calls: int = 2, *, minutes: int = 0, **kw) -> list[dict]:
    """``n_calls`` valid calls created ``minutes`` after T0 (one second apart)."""
    return [
        make_call(trajectory_id, i, created_at=T0 + timedelta(minutes=minutes, seconds=i), **kw)
        for i in range(n_calls)
    ]


def make_reward(trajectory_id: str, reward: float = 1.0, *, minutes: int = 0, source: str = "test") -> dict:
    return {
        "trajectory_id": trajectory_id,
        "reward": reward,
        "source": source,
        "created_at": T0 + timedelta(minutes=minutes),
    }


def wait_healthy(proc, url: str, headers: dict | None = None, timeout_s: float = 120.0, what: str = "the service",
                 log: Path | None = None, kill: bool = True):
    """Poll ``url`` until it answers 200; raise (with the process's stderr, or the tail of ``log``
    where its output goes) if ``proc`` exits or it times out (killing it, unless ``kill`` is False)."""
    import time

    import httpx

    def output() -> str:
        return log.read_text(errors="replace")[-2000:] if log is not None else proc.stderr.read().decode()[-2000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {output()}")
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    if kill:
        proc.kill()
    raise RuntimeError(f"{what} did not come up in {timeout_s:.0f} s: {output() if log is not None else ''}")


def count_nonfinite(state_dict: dict) -> dict[str, int]:
    """Tensor name -> number of NaN/Inf entries, only for tensors that have any (the gate's input)."""
    import torch

    bad = {}
    for name, t in state_dict.items():
        if t.is_floating_point():
            n = int((~torch.isfinite(t)).sum())
            if n:
                bad[name] = n
    return bad


def drop_schemas(pg_url: str, prefix: str) -> None:
    """Drop the stack's schemas (tests clean up with this; the stack itself never drops them)."""
    import psycopg2

    from prodrl_pipelines.stack.postgres import libpq_dsn, schema_names

    conn = psycopg2.connect(libpq_dsn(pg_url), connect_timeout=5)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for schema in schema_names(prefix).values():
                cur.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        conn.close()


@contextlib.contextmanager
def watch_endpoint(home: Path, also: Callable[[], None] | None = None, every_s: float = 0.05) -> Iterator[list]:
    """While the block runs (a rolling update), the endpoint file's replica versions every ``every_s``
    (and ``also()`` beside): yields the list they are appended to."""
    from prodrl_pipelines.deploy_targets import endpoint_file

    seen: list[list[str]] = []
    stop = threading.Event()

    def watcher() -> None:
        while not stop.is_set():
            seen.append([r["policy_version"] for r in endpoint_file(home).read().replica_list()])
            if also is not None:
                also()
            time.sleep(every_s)

    w = threading.Thread(target=watcher)
    w.start()
    try:
        yield seen
    finally:
        stop.set()
        w.join()


def until(what: str, cond, timeout_s: float = 180.0, every_s: float = 0.2):
    """Poll ``cond()`` until it is truthy (returned) or ``timeout_s`` passes (AssertionError naming ``what``):
    the state a test needs, under a ceiling a fast machine never reaches."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = cond()
        if out:
            return out
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
