"""Trajectory store at production volume: sensor tick and selection against history and file count.

Two axes, each measured side by side in one run:

* history: a store holding 1 vs ``--rounds`` rounds (each round: its own policy version, traffic of
  ``--trajectories`` trajectories x 3 calls in ``--round-parts`` recorder commits, a rewards commit,
  the round's ledger), compacted as the hourly maintenance job leaves it. Tick = one
  ``EligibilityTracker.count`` after one new recorder commit and its rewards (the steady state of
  the sensor; median of ``--repeats``). Selection = ``select_round_dataset`` of the live window.
* files: one version's 12,288 calls (``--part-trajectories`` x 3) written in 16 vs ``--parts``
  recorder commits, then compacted; tick as above.

On the S3 endpoint (a moto server on loopback; the history store is uploaded as it is), every
boto3 request of a tick is counted through botocore's event hooks: the tick's requests must not
grow with history. Last line:

    store_scale: tick(256)/tick(1)=X; tick(4096 parts, compacted)/tick(16 parts)=X; s3 requests per tick at 256 rounds=N; select(256)/select(1)=X

Usage: ``python bench/store_scale.py [--rounds 256] [--parts 4096] [--trajectories 64] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): 3 rounds of 8 trajectories, 192 calls in 16 vs 32 parts, one repeat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
from _smoke import parse_args

from prodrl_pipelines.trajectories import maintenance
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.eligibility import EligibilityTracker
from prodrl_pipelines.trajectories.selection import select_round_dataset
from prodrl_pipelines.trajectories.store import TrajectoryStore

VOCAB = 1000
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
# the ticks' new traffic is recorded now, after everything the stores hold (the history's rounds are
# minutes after T0): a call of the live version stamped before its first call would move the
# window's start earlier, and the tick would rebuild and widen what it sees instead of measuring one
NOW_MINUTES = 365 * 24 * 60


def calls_of(prefix: str, n_traj: int, version: str, rng, n_calls: int = 3, minutes: int = 0) -> list[dict]:
    rows = []
    for t in range(n_traj):
        for c in range(n_calls):
            n_out = int(rng.integers(8, 24))
            rows.append({
                "trajectory_id": f"{prefix}-{t}", "call_index": c, "policy_version": version, "task_id": "task",
                "prompt_token_ids": rng.integers(0, VOCAB, 32 * (c + 1)).tolist(),
                "output_token_ids": rng.integers(0, VOCAB, n_out).tolist(),
                "output_logprobs": (-rng.random(n_out)).tolist(),
                "top_token_ids": rng.integers(0, VOCAB, (n_out, 4)).tolist(),
                "top_logprobs": (-rng.random((n_out, 4))).tolist(),
                "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                "created_at": T0 + timedelta(minutes=minutes, seconds=t),
            })
    return rows


def rewards_of(prefix: str, n_traj: int, rng) -> list[dict]:
    return [{"trajectory_id": f"{prefix}-{t}", "reward": float(rng.random()), "source": "bench",
             "created_at": T0} for t in range(n_traj)]


def write_parts(store: TrajectoryStore, rows: list[dict], parts: int) -> None:
    for chunk in np.array_split(np.arange(len(rows)), parts):
        if len(chunk):
            store.write_calls([rows[i] for i in chunk])


def build_history(root: Path, rounds: int, n_traj: int, round_parts: int, seed: int = 0) -> TrajectoryStore:
    store = TrajectoryStore(LocalBlobStore(root))
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        v = f"v{r:04d}"
        write_parts(store, calls_of(f"r{r}", n_traj, v, rng, minutes=r), round_parts)
        store.write_rewards(rewards_of(f"r{r}", n_traj, rng))
        if r:  # the previous version's traffic was trained on by round r
            store.write_ledger(f"round-{r:06d}", [f"r{r - 1}-{t}" for t in range(n_traj)])
    maintenance.compact(store)
    return store


def tick_time(store: TrajectoryStore, live: str, order: list[str], repeats: int, rng, tag: str) -> float:
    tracker = EligibilityTracker(store, VOCAB)
    tracker.count(live, order, 0)  # the first tick builds the state from a snapshot
    times = []
    for i in range(repeats):
        store.write_calls(calls_of(f"{tag}-new{i}", 8, live, rng, minutes=NOW_MINUTES + i))  # one recorder commit
        store.write_rewards(rewards_of(f"{tag}-new{i}", 8, rng))
        t = time.perf_counter()
        rep = tracker.count(live, order, 0, report=True)
        times.append(time.perf_counter() - t)
        assert rep.rebuilt is None and rep.commits_read == 2, rep
    return float(np.median(times))


def select_time(store: TrajectoryStore, live: str, order: list[str], repeats: int, least: int = 32) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        select_round_dataset(store, "round-bench", live, order, 0, least, VOCAB, record=False)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_requests_per_tick(local_root: Path, live: str, order: list[str], rng) -> tuple[int, int]:
    """Upload the history store to a moto S3 server; count boto3 requests of steady-state ticks."""
    import boto3

    from prodrl_pipelines.storage.s3 import S3BlobStore

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    port = _free_port()
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        client = boto3.client("s3", endpoint_url=url)
        client.create_bucket(Bucket="bench")
        files = [p for p in local_root.rglob("*") if p.is_file() and not p.name.startswith(".")]
        for p in files:
            client.upload_file(str(p), "bench", "store/" + p.relative_to(local_root).as_posix())
        blobs = S3BlobStore("bench", "store", endpoint_url=url)
        store = TrajectoryStore(blobs)
        counts = []
        blobs.client.meta.events.register("before-send.s3.*", lambda **kw: counts.append(1))
        tracker = EligibilityTracker(store, VOCAB)
        tracker.count(live, order, 0)
        per_tick = []
        for i in range(3):
            store.write_calls(calls_of(f"s3-new{i}", 8, live, rng, minutes=NOW_MINUTES + i))
            store.write_rewards(rewards_of(f"s3-new{i}", 8, rng))
            counts.clear()
            tracker.count(live, order, 0)
            per_tick.append(len(counts))
        return max(per_tick), len(files)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=256)
    ap.add_argument("--parts", type=int, default=4096)
    ap.add_argument("--trajectories", type=int, default=64, help="per round")
    ap.add_argument("--round-parts", type=int, default=4, help="recorder commits per round")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--part-trajectories", type=int, default=4096, help="of the files axis' version (x 3 calls)")
    args = parse_args(ap, rounds=3, parts=32, trajectories=8, round_parts=2, repeats=1, part_trajectories=64)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        res = {}
        for rounds in (1, args.rounds):
            t = time.perf_counter()
            store = build_history(tmp / f"h{rounds}", rounds, args.trajectories, args.round_parts)
            order = [f"v{r:04d}" for r in range(rounds)]
            live = order[-1]
            files = sum(1 for p in (tmp / f"h{rounds}").rglob("*.parquet"))
            res[rounds] = (tick_time(store, live, order, args.repeats, rng, f"h{rounds}"),
                           select_time(store, live, order, args.repeats, min(32, args.trajectories)))
            print(f"history {rounds:4d} rounds ({files} files, built in {time.perf_counter() - t:.0f} s): "
                  f"tick {res[rounds][0] * 1e3:.1f} ms, selection {res[rounds][1] * 1e3:.1f} ms", flush=True)
        s3_req, s3_files = s3_requests_per_tick(tmp / f"h{args.rounds}", f"v{args.rounds - 1:04d}",
                                                [f"v{r:04d}" for r in range(args.rounds)], rng)
        print(f"S3 (moto, {s3_files} objects uploaded): {s3_req} requests per steady-state tick", flush=True)

        parts = {}
        calls = calls_of("p", args.part_trajectories, "v0", np.random.default_rng(2))  # 12,288 calls at full size
        for n in (16, args.parts):
            store = TrajectoryStore(LocalBlobStore(tmp / f"p{n}"))
            t = time.perf_counter()
            write_parts(store, calls, n)
            store.write_rewards(rewards_of("p", args.part_trajectories, rng))
            wrote = time.perf_counter() - t
            raw = tick_time(store, "v0", ["v0"], args.repeats, rng, f"p{n}raw")
            maintenance.compact(store)
            parts[n] = tick_time(store, "v0", ["v0"], args.repeats, rng, f"p{n}")
            print(f"{n:5d} parts (written in {wrote:.0f} s): tick {raw * 1e3:.1f} ms before compaction, "
                  f"{parts[n] * 1e3:.1f} ms compacted", flush=True)

    tick_ratio = res[args.rounds][0] / res[1][0]
    parts_ratio = parts[args.parts] / parts[16]
    select_ratio = res[args.rounds][1] / res[1][1]
    print(f"store_scale: tick({args.rounds})/tick(1)={tick_ratio:.2f}; tick({args.parts} parts, compacted)/"
          f"tick(16 parts)={parts_ratio:.2f}; s3 requests per tick at {args.rounds} rounds={s3_req}; "
          f"select({args.rounds})/select(1)={select_ratio:.2f}")


if __name__ == "__main__":
    main()
