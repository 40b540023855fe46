"""Selection and a recorder start against history: 1 vs ``--rounds`` rounds, side by side in one run.

Each round of the history: its own policy version, ``--trajectories`` trajectories x 3 calls in
``--round-parts`` recorder commits, a few retried calls (a retraction and the retry's row), a
rewards commit, the round's ledger, and a flush of the recorder's skipped calls; compacted as the
hourly maintenance job leaves it. Measured (medians of ``--repeats``, the two stores interleaved):

* ``select_round_dataset`` of the live window (``record=False``): what it reads must not grow with
  history (retractions, rewards and ledger rows are read for the window's trajectories only);
* a recorder start (``Ingestor.recover``): the skipped-call objects it reads (after the first start
  folded them).

Last line::

    selection_scale: ratio=X (select(N)=A ms, select(1)=B ms); skipped parts read at start: N rounds=P, 1 round=Q

Usage: ``python bench/selection_scale.py [--rounds 256] [--trajectories 64] [--repeats 9] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): 3 rounds of 8 trajectories, one repeat.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import parse_args  # noqa: E402
from store_scale import T0, VOCAB, calls_of, rewards_of, write_parts  # noqa: E402

from prodrl_pipelines.recorder.ingest import Ingestor  # noqa: E402
from prodrl_pipelines.recorder.skips import SKIPPED_PREFIX, write_skips  # noqa: E402
from prodrl_pipelines.storage.blobstore import LocalBlobStore  # noqa: E402
from prodrl_pipelines.trajectories import maintenance  # noqa: E402
from prodrl_pipelines.trajectories.selection import select_round_dataset  # noqa: E402
from prodrl_pipelines.trajectories.store import TrajectoryStore  # noqa: E402


class CountingBlobs(LocalBlobStore):
    def __init__(self, root):
        super().__init__(root)
        self.gets: list[str] = []

    def get_bytes(self, key):
        self.gets.append(key)
        return super().get_bytes(key)


def build(root: Path, rounds: int, n_traj: int, round_parts: int, seed: int = 0) -> TrajectoryStore:
    store = TrajectoryStore(CountingBlobs(root))
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        v = f"v{r:04d}"
        rows = calls_of(f"r{r}", n_traj, v, rng, minutes=r)
        write_parts(store, rows, round_parts)
        retried = rows[:3]  # three retried calls: the earlier rows retracted, the retries written
        store.retract_calls([{k: c[k] for k in ("trajectory_id", "call_index", "created_at")} for c in retried])
        store.write_calls([{**c, "created_at": c["created_at"] + timedelta(seconds=30)} for c in retried])
        store.write_rewards(rewards_of(f"r{r}", n_traj, rng))
        write_skips(store.blobs, [{"trajectory_id": f"r{r}-skip", "call_index": 0, "reason": "bench",
                                   "created_at": int((T0 + timedelta(minutes=r)).timestamp() * 1e6)}])
        if r:
            store.write_ledger(f"round-{r:06d}", [f"r{r - 1}-{t}" for t in range(n_traj)])
    maintenance.compact(store)
    return store


def select_ms(store: TrajectoryStore, order: list[str], least: int = 32) -> float:
    t = time.perf_counter()
    res = select_round_dataset(store, "round-bench", order[-1], order, 0, least, VOCAB, record=False)
    assert res.n_eligible > 0
    return (time.perf_counter() - t) * 1e3


def start_reads(store: TrajectoryStore, wal: Path) -> int:
    """Skipped-call objects one recorder start reads (after an earlier start folded them)."""
    Ingestor(store, wal).recover()
    store.blobs.gets.clear()
    Ingestor(store, wal).recover()
    return sum(k.startswith(SKIPPED_PREFIX) for k in store.blobs.gets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=256)
    ap.add_argument("--trajectories", type=int, default=64, help="per round")
    ap.add_argument("--round-parts", type=int, default=4, help="recorder commits per round")
    ap.add_argument("--repeats", type=int, default=9)
    args = parse_args(ap, rounds=3, trajectories=8, round_parts=2, repeats=1)
    least = min(32, args.trajectories)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stores, orders = {}, {}
        for rounds in (1, args.rounds):
            t = time.perf_counter()
            stores[rounds] = build(tmp / f"h{rounds}", rounds, args.trajectories, args.round_parts)
            orders[rounds] = [f"v{r:04d}" for r in range(rounds)]
            files = sum(1 for _ in (tmp / f"h{rounds}").rglob("*.parquet"))
            print(f"history {rounds:4d} rounds: {files} files, built in {time.perf_counter() - t:.0f} s", flush=True)
        times: dict[int, list[float]] = {1: [], args.rounds: []}
        for rounds in times:  # warm: the first read of a store opens its tables
            select_ms(stores[rounds], orders[rounds], least)
        for _ in range(args.repeats):
            for rounds in times:
                times[rounds].append(select_ms(stores[rounds], orders[rounds], least))
        med = {r: float(np.median(v)) for r, v in times.items()}
        reads = {r: start_reads(stores[r], tmp / f"wal{r}") for r in times}
        for r in times:
            print(f"{r:4d} rounds: selection {med[r]:.1f} ms (runs {', '.join(f'{x:.0f}' for x in times[r])}); "
                  f"skipped-call parts read at a recorder start: {reads[r]}", flush=True)
    ratio = med[args.rounds] / med[1]
    print(f"selection_scale: ratio={ratio:.2f} (select({args.rounds})={med[args.rounds]:.1f} ms, "
          f"select(1)={med[1]:.1f} ms); skipped parts read at start: {args.rounds} rounds={reads[args.rounds]}, "
          f"1 round={reads[1]}")


if __name__ == "__main__":
    main()
