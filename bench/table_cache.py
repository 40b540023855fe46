"""Memory of a long-running recorder's table handles: every snapshot kept (as before) vs a bounded cache.

A recorder appends to the calls table for as long as it runs, and each append opens the table (to
write, to read the committed version, to check its application transaction). Two processes run the
same workload side by side: ``--appends`` appends of ``--rows`` calls each with the recorder's reads
around it, the store compacted every ``--compact-every`` appends as the maintenance job leaves it;
one keeps every snapshot it opened (``max_open`` unbounded: the behaviour before the cache was
bounded), the other the default ``MAX_OPEN_SNAPSHOTS``. Each reports its resident memory (RSS,
where delta-rs's Rust allocations show; tracemalloc sees only Python's) after a warm-up, half-way
and at the end, and the DeltaTable objects alive. Bounded means flat: the second half's growth is
what a recorder running for days would keep adding per ``appends/2`` commits. Last line:

    table_cache: appends=N; rss_growth_unbounded_mb=X; rss_growth_bounded_mb=X; ratio=X; second_half_unbounded_mb=X; second_half_bounded_mb=X; open_unbounded=N; open_bounded=N

Usage: ``python bench/table_cache.py [--appends 400] [--rows 8] [--compact-every 100] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): 24 appends, compacted every 8.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _smoke import parse_args

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
WARMUP = 20  # appends before the first reading: imports and allocator pools settle


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rows_of(k: int, n: int) -> list[dict]:
    return [{"trajectory_id": f"t{k}-{i}", "call_index": 0, "policy_version": "v1", "task_id": "task",
             "prompt_token_ids": list(range(32)), "output_token_ids": list(range(16)),
             "output_logprobs": [-0.5] * 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
             "created_at": T0} for i in range(n)]


def worker(root: str, max_open: int, appends: int, rows: int, compact_every: int) -> dict:
    from deltalake import DeltaTable

    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories import maintenance
    from prodrl_pipelines.trajectories.store import CALLS, TrajectoryStore
    from prodrl_pipelines.trajectories.tables import DeltaTables

    store = TrajectoryStore(LocalBlobStore(root))
    store.tables = DeltaTables(store.blobs, max_open=max_open)
    start = half = None
    warmup = min(WARMUP, appends // 4)  # a smoke run has fewer appends than the warm-up
    t0 = time.perf_counter()
    for k in range(appends):
        if k == warmup:
            gc.collect()
            start = rss_mb()
            t0 = time.perf_counter()
        if k == appends // 2:
            gc.collect()
            half = rss_mb()
        store.write_calls(rows_of(k, rows), txn=("bench-writer", k + 1))
        store.tables.txn_version(CALLS, "bench-writer")  # the flusher's "did it land" check
        store.tables.open(CALLS, store.tables.version(CALLS))  # a reader pinning the version it saw
        if compact_every and (k + 1) % compact_every == 0:
            maintenance.compact(store, [CALLS])
    elapsed = time.perf_counter() - t0
    gc.collect()
    end = rss_mb()
    live = sum(1 for o in gc.get_objects() if isinstance(o, DeltaTable))
    return {"rss_start_mb": start, "rss_end_mb": end, "growth_mb": end - start, "second_half_mb": end - half,
            "live_tables": live,
            "ms_per_append": elapsed / max(appends - warmup, 1) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--appends", type=int, default=400)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--compact-every", type=int, default=100)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # max_open of a child run
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parse_args(ap, appends=24, compact_every=8)
    if args.worker is not None:
        print(json.dumps(worker(args.root, args.worker, args.appends, args.rows, args.compact_every)))
        return
    from prodrl_pipelines.trajectories.tables import MAX_OPEN_SNAPSHOTS

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, max_open in (("unbounded", 10**9), ("bounded", MAX_OPEN_SNAPSHOTS)):
            proc = subprocess.run([sys.executable, __file__, "--worker", str(max_open), "--root",
                                   str(Path(tmp) / label), "--appends", str(args.appends), "--rows", str(args.rows),
                                   "--compact-every", str(args.compact_every)],
                                  capture_output=True, text=True, check=True)
            out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{'':>10} {'rss start MB':>13} {'rss end MB':>11} {'growth MB':>10} {'2nd half MB':>12} "
          f"{'open tables':>12} {'ms/append':>10}")
    for label, r in out.items():
        print(f"{label:>10} {r['rss_start_mb']:13.1f} {r['rss_end_mb']:11.1f} {r['growth_mb']:10.1f} "
              f"{r['second_half_mb']:12.1f} {r['live_tables']:12d} {r['ms_per_append']:10.1f}")
    u, b = out["unbounded"], out["bounded"]
    ratio = u["growth_mb"] / max(b["growth_mb"], 1.0)  # growth under 1 MB counts as 1 MB: no division by noise
    print(f"table_cache: appends={args.appends}; rss_growth_unbounded_mb={u['growth_mb']:.1f}; "
          f"rss_growth_bounded_mb={b['growth_mb']:.1f}; ratio={ratio:.1f}; second_half_unbounded_mb={u['second_half_mb']:.1f}; "
          f"second_half_bounded_mb={b['second_half_mb']:.1f}; open_unbounded={u['live_tables']}; "
          f"open_bounded={b['live_tables']}")


if __name__ == "__main__":
    main()
