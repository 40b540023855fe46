"""Steady client traffic through a recorder, run on a client host of the simulated hosts
(``cluster/hosts.py``) by tests/test_hosts.py and bench/hosts.py:

    python -m prodrl_pipelines.cluster.traffic URL TOKEN OUT_DIR [WORKERS [PAUSE_S]]

Each worker makes calls one after another (trajectory ``w<i>-<n>``, 2 calls each; ``PAUSE_S`` between
trajectories, 0 by default: back to back, as the bench measures capacity) until ``OUT_DIR/stop``
exists; ``OUT_DIR/progress`` counts the answered calls as they come, and at the end
``OUT_DIR/result.json`` holds every acknowledged call (trajectory id, call index, the version that
answered) and every failure.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx


def main(url: str, token: str, out: str, workers: int = 3, pause_s: float = 0.0) -> None:
    out_dir = Path(out)
    acked, failed, lock = [], [], threading.Lock()

    def worker(i: int) -> None:
        n = 0
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=300) as h:
            while not (out_dir / "stop").exists():
                tid = f"w{i}-{n}"
                for k in range(2):
                    try:
                        r = h.post("/v1/completions", json={"model": "any", "prompt": [1, 5, 6, 7, 8][: 3 + k],
                                                            "max_tokens": 3}, headers={"X-Trajectory-Id": tid})
                        if r.status_code == 200:
                            with lock:
                                acked.append([tid, int(r.headers["x-call-index"]), r.json()["model"], time.time()])
                        else:
                            with lock:
                                failed.append([tid, r.status_code, r.text[:300], time.time()])
                    except httpx.HTTPError as e:
                        with lock:
                            failed.append([tid, 0, f"{type(e).__name__}: {e}", time.time()])
                with lock:
                    (out_dir / "progress").write_text(str(len(acked)))
                n += 1
                time.sleep(pause_s)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (out_dir / "result.json").write_text(json.dumps({"acked": acked, "failed": failed}))


def stored(store_args: list[str], acked_file: str) -> dict:
    """How many of the acknowledged calls in ``acked_file`` (a ``result.json``) the recorder's store holds,
    and how many rows it holds twice; ``store_args``: ``--store DIR`` or ``--s3-bucket B --s3-endpoint-url U``."""
    import argparse

    from prodrl_pipelines.storage.locations import StoreLocation
    from prodrl_pipelines.trajectories.store import TrajectoryStore

    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default="")
    ap.add_argument("--s3-bucket", default="")
    ap.add_argument("--s3-endpoint-url", default="")
    a = ap.parse_args(store_args)
    if a.store:
        from prodrl_pipelines.storage.blobstore import LocalBlobStore

        store = TrajectoryStore(LocalBlobStore(a.store))
    else:
        store = TrajectoryStore(StoreLocation(s3_bucket=a.s3_bucket, s3_endpoint_url=a.s3_endpoint_url).blobs(None))
    calls = store.read_calls(dedupe=False, columns=["trajectory_id", "call_index"])
    rows = list(zip(calls.column("trajectory_id").to_pylist(), calls.column("call_index").to_pylist()))
    acked = {(t, i) for t, i, *_ in json.loads(Path(acked_file).read_text())["acked"]}
    return {"acked": len(acked), "lost": len(acked - set(rows)), "twice": len(rows) - len(set(rows))}


if __name__ == "__main__":
    if sys.argv[1] == "stored":  # python -m ... stored RESULT_JSON --store DIR | --s3-bucket B --s3-endpoint-url U
        print(json.dumps(stored(sys.argv[3:], sys.argv[2])), flush=True)
        import os

        os._exit(0)  # a native S3 client's threads can abort the interpreter's exit; the answer is out
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5]),
             *(float(a) for a in sys.argv[5:6]))
