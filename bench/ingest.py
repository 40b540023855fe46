"""Recorder ingest throughput: recorded calls per second into Parquet, and bytes per generated token.

Synthetic calls shaped like production traffic (default: 512 prompt tokens, 128 generated tokens,
K = 20 top logprobs per position, vocabulary 151,936; ids and logprobs drawn at random, which
compresses worse than real traffic, so the sizes are an upper bound). Three measurements:

* ``pipeline``: ``Ingestor.commit_call`` from 32 concurrent producer threads -> WAL (group commit,
  fdatasync) -> flusher -> ``TrajectoryStore.write_calls`` (zstd Parquet parts), timed until the
  last call is in Parquet;
* ``parquet only``: ``TrajectoryStore.write_calls`` on batches of ``--flush-rows`` rows;
* ``wal only``: framed-entry encoding + append + fdatasync, in groups of 32.

Bytes per generated token: the Parquet parts' total size (and the WAL's) divided by the number of
generated tokens.

Last line: ``ingest: pipeline calls/s=X; parquet only calls/s=X; wal only calls/s=X; parquet bytes/token=X;
wal bytes/token=X``.

Usage: ``python bench/ingest.py [--calls 4096] [--prompt 512] [--output 128] [--k 20] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): 64 calls of 32 + 8 tokens, K = 4, 4 producers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _smoke import parse_args

from prodrl_pipelines.recorder.ingest import Ingestor
from prodrl_pipelines.recorder.wal import WriteAheadLog, encode_entry
from prodrl_pipelines.storage.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore


def make_rows(n: int, prompt: int, output: int, k: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        heads = rng.integers(0, vocab, (output, k))
        head_lps = -np.sort(rng.exponential(2.0, (output, k)), axis=1).astype(np.float32)
        rows.append({
            "task_id": f"task-{i % 997}",
            "policy_version": "round-000001",
            "prompt_token_ids": rng.integers(0, vocab, prompt).tolist(),
            "output_token_ids": heads[:, 0].tolist(),
            "output_logprobs": head_lps[:, 0].astype(float).tolist(),
            "top_token_ids": heads.tolist(),
            "top_logprobs": head_lps.astype(float).tolist(),
            "support_complete": False,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "prompt_text": "x" * (prompt * 3), "output_text": "y" * (output * 3),
        })
    return rows


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--flush-rows", type=int, default=1024)
    ap.add_argument("--producers", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = parse_args(ap, calls=64, prompt=32, output=8, k=4, vocab=1000, flush_rows=16, producers=4)

    tmp = Path(tempfile.mkdtemp(prefix="ingest-bench-"))
    n_distinct = min(args.calls, 512)  # generating rows is slower than ingesting them: reuse
    base = make_rows(n_distinct, args.prompt, args.output, args.k, args.vocab)
    tokens = args.calls * args.output
    out: dict = {"setup": {k: getattr(args, k) for k in ("calls", "prompt", "output", "k", "vocab", "flush_rows",
                                                         "producers")}}

    # -- the whole pipeline
    store_dir, wal_dir = tmp / "pipeline-store", tmp / "pipeline-wal"
    ing = Ingestor(TrajectoryStore(LocalBlobStore(store_dir)), wal_dir, flush_rows=args.flush_rows,
                   flush_interval_s=3600)
    ing.start()
    wal_peak = [0]

    def producer(p: int) -> None:
        for i in range(p, args.calls, args.producers):
            _, fut, _ = ing.commit_call(f"traj-{i}", dict(base[i % n_distinct]))
            fut.result()
            if i % 256 == 0:
                wal_peak[0] = max(wal_peak[0], dir_bytes(wal_dir))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=producer, args=(p,)) for p in range(args.producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_ack = time.perf_counter() - t0
    ing.flush(600)
    t_all = time.perf_counter() - t0
    ing.stop()
    parquet = dir_bytes(store_dir / "tables" / "calls")  # data files and the table log
    stats = ing.stats.as_dict()
    out["pipeline"] = {
        "acknowledged_calls_per_s": args.calls / t_ack,
        "calls_per_s_into_parquet": args.calls / t_all,
        "generated_tokens_per_s": tokens / t_all,
        "parquet_bytes_per_generated_token": parquet / tokens,
        "wal_bytes_per_generated_token": ing.wal.bytes_written / tokens,
        "fsyncs": stats.get("wal_fsyncs", 0),
        "calls_per_fsync": args.calls / max(stats.get("wal_fsyncs", 1), 1),
    }

    # -- Parquet only
    store = TrajectoryStore(LocalBlobStore(tmp / "parquet-store"))
    rows = [{**base[i % n_distinct], "trajectory_id": f"t-{i}", "call_index": 0, "created_at": 1_800_000_000_000_000 + i}
            for i in range(args.calls)]
    t0 = time.perf_counter()
    for at in range(0, args.calls, args.flush_rows):
        store.write_calls(rows[at : at + args.flush_rows])
    t_pq = time.perf_counter() - t0
    out["parquet_only"] = {"calls_per_s": args.calls / t_pq,
                           "bytes_per_generated_token": dir_bytes(tmp / "parquet-store") / tokens}

    # -- WAL only
    wal = WriteAheadLog(tmp / "wal-only")
    wal.open()
    t0 = time.perf_counter()
    for at in range(0, args.calls, args.producers):
        wal.append(encode_entry({"kind": "call", "row": r}) for r in rows[at : at + args.producers])
    t_wal = time.perf_counter() - t0
    wal.close()
    out["wal_only"] = {"calls_per_s": args.calls / t_wal, "bytes_per_generated_token": wal.bytes_written / tokens}

    print(f"{args.calls} calls of {args.prompt} prompt + {args.output} generated tokens, K={args.k}, "
          f"vocab {args.vocab}, flush every {args.flush_rows} rows, {os.cpu_count()} CPUs")
    p = out["pipeline"]
    print(f"pipeline (WAL + fsync + Parquet): {p['calls_per_s_into_parquet']:.0f} calls/s into Parquet "
          f"({p['generated_tokens_per_s']:.0f} generated tokens/s), acknowledged at {p['acknowledged_calls_per_s']:.0f}"
          f" calls/s, {p['calls_per_fsync']:.1f} calls per fsync")
    print(f"  on disk: {p['parquet_bytes_per_generated_token']:.1f} B/generated token in Parquet, "
          f"{p['wal_bytes_per_generated_token']:.1f} B/token through the WAL")
    print(f"parquet only: {out['parquet_only']['calls_per_s']:.0f} calls/s; "
          f"wal only: {out['wal_only']['calls_per_s']:.0f} calls/s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"ingest: pipeline calls/s={p['calls_per_s_into_parquet']:.0f}; "
          f"parquet only calls/s={out['parquet_only']['calls_per_s']:.0f}; "
          f"wal only calls/s={out['wal_only']['calls_per_s']:.0f}; "
          f"parquet bytes/token={p['parquet_bytes_per_generated_token']:.1f}; "
          f"wal bytes/token={p['wal_bytes_per_generated_token']:.1f}")


if __name__ == "__main__":
    main()
