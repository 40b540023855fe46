"""What the recorder costs: throughput and latency through ``prodrl record``, against calling the upstream directly.

Loopback, one run: ``prodrl serve`` (the tiny lab model, one torch thread) and ``prodrl record`` in
front of it, each its own process (uvicorn with uvloop/httptools), started from the same source
tree as this script's ``prodrl_pipelines`` (``PYTHONPATH``; the tree is printed). The load
generator is the official ``openai`` client in this process: ``openai.AsyncOpenAI`` (``max_retries=0``,
one client per phase, its keep-alive connection pool sized to the concurrency, connections opened
and warmed before the clock starts), ``client.completions.create(model=..., prompt=[token ids],
max_tokens=16)``, unseeded so the upstream batches. Through the recorder the client sends the
recorder's bearer token as its ``api_key`` and one ``X-Trajectory-Id`` per worker and phase (each
worker is an agent appending to its trajectory); the recorder asks the upstream for the recording
fields (token ids, 20 top logprobs), records the call (WAL fsync before the answer) and gives the
client the answer it asked for.

Closed loop: ``C`` workers, each sending its next request when the last is answered, for
``--seconds`` per phase, at concurrency ``C`` = 1, 8 and 32. Phases are interleaved in one run
(each round: for each concurrency, ``direct`` then ``recorder``; over the rounds ABAB at every
concurrency) so that drift hits both alike. Per concurrency it prints requests/s and p50/p99
latency of ``direct`` and ``recorder``, prompts per engine call of the upstream, the CPU time per
request of each process and the cores that everything else used meanwhile (other users of the
shared cores, the kernel's loopback work: the noise); the throughput ratio recorder/direct and the
added p50 (over all rounds, and the spread of the per-round values), with PASS/MISS against the
goals: ratio >= 0.95 and added p50 <= 1 ms at every concurrency.

Where the recorder's time goes: its ``time_us.*`` counters (``/stats``), taken around each
recorder phase, divided per call: ``before_upstream`` (reading and parsing the client's body,
the forced fields), ``upstream`` (waiting for the upstream's answer), ``after_upstream`` (parsing
the answer, building the row, rewriting the client's answer), ``commit_wait`` (waiting for the WAL
group fsync); and per WAL group: calls per fsync, ``wal_append`` (encode + write + fdatasync)
per fsync, ``wal_entry_wait`` per entry. What is left of the added mean latency is uvicorn, the
extra hop's sockets and the scheduling of three processes on shared cores.

A last pair of phases per concurrency replaces the upstream by a process that answers instantly
with a recorded answer of the tiny model (with the recording fields when asked for them, without
otherwise): ``instant`` (the client straight to it) and ``instant+rec`` (through a second
recorder): the proxy's own ceiling (requests/s, latency, recorder CPU per call).

On these machines all processes (upstream, recorder, this load generator) share 2 CPU cores, so
the recorder's CPU time is taken from the upstream, and the proxy relays a returning batch of
answers one after the other, which splits the local engine's static batches (vLLM batches
continuously): both make the comparison pessimistic for a recorder in front of a GPU server.
``--pin`` puts the upstream on CPU 0 and the recorder and the load generator on CPU 1.

``--compare-src DIR`` adds ``recorder (base)`` (and ``instant+rec (base)``): the same recorder
from another source tree (e.g. ``mkdir /tmp/base && git archive <rev> prodrl_pipelines | tar -x -C
/tmp/base``), in front of the same upstream, interleaved with the others: before/after in one run.

Observability: a third recorder, ``recorder+obs``, runs with its per-request metrics (histograms, the
in-flight gauge) and its JSON request log on; ``recorder`` runs with ``--no-request-metrics`` and no
log, as before they existed. Interleaved with the others; the line before the last:
``observability: recorder/direct metrics+logs on/off c=8=X; added latency p50/p99 ms=X/Y; erase 1 tenant of 10 over 100k calls s=X``
(X of the first part: ``recorder+obs`` requests/s over ``recorder``'s, goal >= 0.97; the added
latency: ``recorder+obs`` minus ``direct``, client side; the erasure: ``prodrl data erase --tenant``
of one tenant of 10 in a local store of ``--erase-calls`` calls, files removed, checked gone).

Last line: ``recorder_overhead: throughput recorder/direct c=1=X c=8=X c=32=X; added p50 ms c=1=X c=8=X c=32=X;
all goals=PASS`` (MISS when one is missed; the concurrencies measured).

Usage: ``python bench/recorder_overhead.py [--rounds 6] [--seconds 3] [--concurrency 1 8 32]
[--instant-seconds 1.5] [--http aiohttp|httpx] [--pin] [--model-dir DIR] [--compare-src DIR] [--json FILE] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): one round at concurrency 2, 0.3 s per phase, 4 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import parse_args  # noqa: E402

TOKEN = "bench-token"
MODEL = "bench-v0"
PROMPT = [1, 116, 5, 24, 17, 25, 35, 2, 5, 1, 121, 5]
GOAL_RATIO, GOAL_ADDED_P50_MS = 0.95, 1.0
TIME_KEYS = ("before_upstream", "upstream", "after_upstream", "commit_wait")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(src: str | None) -> list[str]:
    """The ``prodrl`` command line: from ``$PYTHONPATH``'s tree, or from the source tree ``src``."""
    if src is None:
        return [sys.executable, "-m", "prodrl_pipelines.cli"]
    launcher = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in "
                "str(getattr(f, '__module__', '')) + repr(f)]; sys.path.insert(0, sys.argv.pop(1)); "
                "from prodrl_pipelines.cli.main import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", launcher, str(Path(src).resolve())]


def spawn(args: list[str], port: int, env: dict, headers: dict | None = None, src: str | None = None,
          log: Path | None = None, timeout_s: float = 120.0) -> subprocess.Popen:
    """``prodrl ARGS`` in its own process, once its /health answers; ``log``: its output goes there
    (in a session of its own), else stderr is kept for the error."""
    if log is None:
        proc = subprocess.Popen([*_cli(src), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    else:
        with open(log, "wb") as out:
            proc = subprocess.Popen([*_cli(src), *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def output() -> str:
        return (log.read_text() if log is not None else proc.stderr.read().decode())[-3000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prodrl {args[0]} exited: {output()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", headers=headers, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"prodrl {args[0]} did not come up" + (f": {output()}" if log is not None else ""))


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process to ``cpus``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy (all cores, all processes; Linux /proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def make_client(base_url: str, api_key: str, concurrency: int, backend: str) -> openai.AsyncOpenAI:
    """One ``AsyncOpenAI`` per phase: no retries, a keep-alive pool of ``concurrency`` connections."""
    import httpx2  # the HTTP library of this openai release (its limits type)

    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=60)
    cls = openai.DefaultAioHttpClient if backend == "aiohttp" else openai.DefaultAsyncHttpxClient
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120,
                              http_client=cls(limits=limits, timeout=120))


async def load(base_url: str, api_key: str, concurrency: int, seconds: float, max_tokens: int, backend: str,
               tid_prefix: str | None, snap) -> dict:
    """Closed loop for ``seconds``: ``concurrency`` workers, each sending its next request when the last
    is answered. ``snap()`` is taken after the warm-up and after the last answer."""
    client = make_client(base_url, api_key, concurrency, backend)
    lat: list[float] = []

    async def call(w: int) -> float:
        hdrs = {"X-Trajectory-Id": f"{tid_prefix}-w{w}"} if tid_prefix else None
        t = time.perf_counter()
        r = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, extra_headers=hdrs)
        dt = time.perf_counter() - t
        if not r.choices or r.choices[0].text is None:
            raise RuntimeError(f"an empty answer: {r}")
        return dt

    async def worker(w: int, deadline: float) -> None:
        while time.perf_counter() < deadline:
            lat.append(await call(w))

    async with client:
        for _ in range(2):  # open the pool's connections (all at once) and warm them
            await asyncio.gather(*(call(w) for w in range(concurrency)))
        s0 = snap()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w, t0 + seconds) for w in range(concurrency)))
        wall = time.perf_counter() - t0
        s1 = snap()
    return {"lat": lat, "wall": wall, "delta": {k: s1[k] - s0[k] for k in s0}}


def run_loop(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:  # the servers' loop, the client's too
        return r.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of interleaved phases")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per phase (direct, recorder) and round")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--instant-seconds", type=float, default=1.5,
                    help="seconds per instant-upstream phase and round (0: leave them out)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--http", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the openai client's HTTP backend (DefaultAioHttpClient or DefaultAsyncHttpxClient); "
                         "aiohttp costs the load generator less CPU, which the servers share")
    ap.add_argument("--model-dir", default=None, help="checkpoint to serve (default: build the tiny lab model)")
    ap.add_argument("--batch-wait-ms", type=float, default=10.0, help="the upstream's longest batching wait")
    ap.add_argument("--batch-quiet-ms", type=float, default=1.0, help="the upstream's quiet gap closing a batch")
    ap.add_argument("--pin", action="store_true",
                    help="upstream on CPU 0, recorder and load generator on CPU 1 (the upstream stands in "
                         "for a GPU server: the recorder's CPU time is not taken from it)")
    ap.add_argument("--compare-src", default=None,
                    help="source tree of another prodrl_pipelines (e.g. the previous commit's): adds 'recorder (base)'")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--erase-calls", type=int, default=100_000,
                    help="calls in the store of the erasure measure (one tenant of 10 erased)")
    args = parse_args(ap, rounds=1, seconds=0.3, concurrency=[2], instant_seconds=0.3, max_tokens=4,
                      erase_calls=2000)
    t_start = time.monotonic()

    import prodrl_pipelines

    src_root = str(Path(prodrl_pipelines.__file__).resolve().parent.parent)
    tmp = Path(tempfile.mkdtemp(prefix="recorder-bench-"))
    model_dir = args.model_dir
    if model_dir is None:
        from prodrl_pipelines.lab.warmstart import build_base_policy

        model_dir = str(build_base_policy(tmp / "model", size="tiny", sft_steps=5, progress=False))
    pypath = os.pathsep.join([src_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    env = {**os.environ, "PRODRL_RECORDER_TOKEN": TOKEN, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": pypath}
    child_src = subprocess.run([sys.executable, "-c", "import prodrl_pipelines; print(prodrl_pipelines.__file__)"],
                               env=env, capture_output=True, text=True, check=True).stdout.strip()
    print(f"prodrl_pipelines: this process {prodrl_pipelines.__file__}, the servers {child_src}")
    if Path(child_src).resolve() != Path(prodrl_pipelines.__file__).resolve():
        raise SystemExit("the servers would import another prodrl_pipelines than this process")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    up_port, rec_port, base_port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []

    def record(upstream_port: int, port: int, store: str, src: str | None = None,
               extra: tuple[str, ...] = ("--no-request-metrics",)) -> subprocess.Popen:
        p = spawn(["record", "--upstream", f"http://127.0.0.1:{upstream_port}", "--store", str(tmp / store),
                   "--port", str(port), "--tokenizer", model_dir, *extra], port, env, auth, src=src)
        procs.append(p)
        return p

    results: dict[tuple[str, int], dict] = {}
    try:
        procs.append(spawn(["serve", model_dir, "--port", str(up_port), "--served-model-name", MODEL,
                            "--threads", "1", "--batch-wait-ms", str(args.batch_wait_ms),
                            "--batch-quiet-ms", str(args.batch_quiet_ms)], up_port, env))
        up_proc = procs[0]
        rec_proc = record(up_port, rec_port, "store")
        # name -> (url, api key, recorder process or None, upstream process, seconds)
        phases = {"direct": (f"http://127.0.0.1:{up_port}", "EMPTY", None, up_proc, args.seconds),
                  "recorder": (f"http://127.0.0.1:{rec_port}", TOKEN, rec_proc, up_proc, args.seconds)}
        # the same recorder with its per-request metrics and its JSON request log on (the one above: off)
        obs_port = free_port()
        phases["recorder+obs"] = (f"http://127.0.0.1:{obs_port}", TOKEN,
                                  record(up_port, obs_port, "store-obs", extra=("--request-log", str(tmp / "requests.jsonl"))),
                                  up_proc, args.seconds)
        if args.compare_src:
            phases["recorder (base)"] = (f"http://127.0.0.1:{base_port}", TOKEN,
                                         record(up_port, base_port, "store-base", args.compare_src), up_proc,
                                         args.seconds)
        if args.instant_seconds > 0:
            # the proxy alone: an instant upstream replaying the tiny model's answers
            fields = {"return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": 20,
                      "temperature": 1.0, "top_p": 1.0, "top_k": -1}
            base = {"model": MODEL, "prompt": PROMPT, "max_tokens": args.max_tokens}
            for name, body in (("full", {**base, **fields}), ("plain", base)):
                ans = httpx.post(f"http://127.0.0.1:{up_port}/v1/completions", json=body, timeout=60)
                ans.raise_for_status()
                (tmp / f"answer-{name}.json").write_bytes(ans.content)
            canned_port, rec2_port, rec3_port = free_port(), free_port(), free_port()
            procs.append(subprocess.Popen([sys.executable, __file__, "--_canned", str(canned_port), str(tmp)],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            canned = procs[-1]
            phases["instant"] = (f"http://127.0.0.1:{canned_port}", "EMPTY", None, canned, args.instant_seconds)
            phases["instant+rec"] = (f"http://127.0.0.1:{rec2_port}", TOKEN, record(canned_port, rec2_port, "store2"),
                                     canned, args.instant_seconds)
            if args.compare_src:
                phases["instant+rec (base)"] = (f"http://127.0.0.1:{rec3_port}", TOKEN,
                                                record(canned_port, rec3_port, "store3", args.compare_src),
                                                canned, args.instant_seconds)
        if args.pin:
            pin(up_proc.pid, {0})
            for p in procs[1:]:
                pin(p.pid, {1})
            os.sched_setaffinity(0, {1})

        def snapper(rec: subprocess.Popen | None, upstream: subprocess.Popen, url: str):
            def snap() -> dict:
                s = {"cpu_up": cpu_seconds(upstream.pid), "cpu_load": time.process_time(),
                     # everything else that ran meanwhile (other users of the shared cores): busy - ours
                     "cpu_others": machine_busy_seconds() - time.process_time()
                     - sum(cpu_seconds(p.pid) for p in procs if p.poll() is None)}
                if upstream is up_proc:
                    u = httpx.get(f"http://127.0.0.1:{up_port}/stats").json()
                    s.update(gen_calls=u["generate_calls"], gen_prompts=u["prompts"])
                if rec is not None:
                    s["cpu_rec"] = cpu_seconds(rec.pid)
                    c = httpx.get(f"{url}/stats", headers=auth).json()["counters"]
                    for k in (*(f"time_us.{t}" for t in TIME_KEYS), "time_us.wal_append", "time_us.wal_entry_wait",
                              "timed_calls", "wal_fsyncs", "wal_appends"):
                        s[k] = c.get(k, 0)
                return s
            return snap

        for rnd in range(args.rounds):
            for conc in args.concurrency:
                for name, (url, key, rec, upstream, secs) in phases.items():
                    out = run_loop(load(url, key, conc, secs, args.max_tokens, args.http,
                                        f"bench-{name.replace(' ', '').replace('(', '').replace(')', '').replace('+', '-')}"
                                        f"-c{conc}-r{rnd}" if rec else None,
                                        snapper(rec, upstream, url)))
                    r = results.setdefault((name, conc), {"lat": [], "wall": 0.0, "n": 0, "rounds": [], "delta": {}})
                    r["lat"] += out["lat"]
                    r["wall"] += out["wall"]
                    r["n"] += len(out["lat"])
                    r["rounds"].append({"req_per_s": len(out["lat"]) / out["wall"], "p50": pct(out["lat"], 0.5)})
                    for k, v in out["delta"].items():
                        r["delta"][k] = r["delta"].get(k, 0) + v
            print(f"round {rnd + 1}/{args.rounds} done ({time.monotonic() - t_start:.0f} s)", flush=True)
        rec_counters = httpx.get(f"http://127.0.0.1:{rec_port}/stats", headers=auth).json()["counters"]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    summary = report(args, phases, results, rec_counters)
    print(f"(total {time.monotonic() - t_start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    goals = {c: summary["goals"][f"recorder c{c}"] for c in args.concurrency}
    c = 8 if 8 in args.concurrency else args.concurrency[0]
    on, off = summary["phases"][f"recorder+obs c{c}"], summary["phases"][f"recorder c{c}"]
    d = summary["phases"][f"direct c{c}"]
    erase_s = erase_one_tenant(args.erase_calls, tmp / "erase-store")
    print(f"observability: recorder/direct metrics+logs on/off c={c}={on['req_per_s'] / off['req_per_s']:.3f} "
          f"(goal >= 0.97); added latency p50/p99 ms={on['p50_ms'] - d['p50_ms']:.2f}/{on['p99_ms'] - d['p99_ms']:.2f}; "
          f"erase 1 tenant of 10 over {args.erase_calls // 1000}k calls s={erase_s:.2f}")
    print("recorder_overhead: throughput recorder/direct " + " ".join(
        f"c={c}={g['throughput_ratio']:.3f}" for c, g in goals.items()) + "; added p50 ms " + " ".join(
        f"c={c}={g['added_p50_ms']:.2f}" for c, g in goals.items())
        + f"; all goals={'PASS' if summary['all_goals_pass'] else 'MISS'}")


def erase_one_tenant(n_calls: int, root: Path) -> float:
    """Seconds for ``prodrl data erase --tenant`` (``trajectories.erasure``) of one tenant of 10 in a
    local store of ``n_calls`` calls (4 per trajectory, 32 tokens each, one reward each), the files
    removed included; checked gone afterwards."""
    from datetime import datetime, timezone

    import pyarrow as pa

    from prodrl_pipelines.storage.blobstore import LocalBlobStore
    from prodrl_pipelines.trajectories.erasure import Erasure, erase
    from prodrl_pipelines.trajectories.schema import CALL_SCHEMA
    from prodrl_pipelines.trajectories.store import TrajectoryStore

    store = TrajectoryStore(LocalBlobStore(root))
    now = datetime.now(timezone.utc)
    n_traj = max(n_calls // 4, 10)
    tids = [f"t{i % 10}/traj-{i}" for i in range(n_traj)]
    for lo in range(0, n_traj, 5000):  # several commits, as a recorder's flushes make
        part = tids[lo:lo + 5000]
        n = 4 * len(part)
        out = [list(range(32))] * n
        cols = {"trajectory_id": [t for t in part for _ in range(4)], "call_index": [k for _ in part for k in range(4)],
                "task_id": ["task"] * n, "policy_version": ["v0"] * n, "prompt_token_ids": [list(range(16))] * n,
                "output_token_ids": out, "output_logprobs": [[-1.0] * 32] * n, "top_token_ids": None,
                "top_logprobs": None, "support_complete": [False] * n, "temperature": [1.0] * n, "top_p": [1.0] * n,
                "top_k": [0] * n, "prompt_text": ["p"] * n, "output_text": ["o"] * n, "created_at": [now] * n}
        store.write_calls(pa.table({f.name: pa.array(cols.get(f.name) or [None] * n, f.type) for f in CALL_SCHEMA},
                                   schema=CALL_SCHEMA))
        store.write_rewards([{"trajectory_id": t, "reward": 1.0, "source": "bench", "created_at": now} for t in part])
    t0 = time.perf_counter()
    report = erase(store, Erasure(tenant="t3", requested_by="bench"))
    took = time.perf_counter() - t0
    left = store.read_calls(columns=["trajectory_id"]).column("trajectory_id").to_pylist()
    assert report["trajectories"] == sum(t.startswith("t3/") for t in tids) and not any(t.startswith("t3/") for t in left)
    return took


def report(args, phases: dict, results: dict, rec_counters: dict) -> dict:
    summary: dict = {"setup": {"concurrency": args.concurrency, "rounds": args.rounds, "seconds": args.seconds,
                               "instant_seconds": args.instant_seconds, "max_tokens": args.max_tokens,
                               "http": args.http, "cpus": os.cpu_count(), "pinned": args.pin,
                               "upstream_batch_wait_ms": args.batch_wait_ms,
                               "upstream_batch_quiet_ms": args.batch_quiet_ms}, "phases": {}, "goals": {},
               "time_split_ms": {}}
    for (name, conc), r in results.items():
        d, n = r["delta"], r["n"]
        s = {"n": n, "req_per_s": n / r["wall"], "others_cores": max(d["cpu_others"], 0.0) / r["wall"],
             "p50_ms": 1000 * pct(r["lat"], 0.5),
             "p99_ms": 1000 * pct(r["lat"], 0.99), "mean_ms": 1000 * statistics.fmean(r["lat"]),
             "cpu_ms_per_req": {"upstream": 1000 * d["cpu_up"] / n, "load": 1000 * d["cpu_load"] / n}}
        if "cpu_rec" in d:
            s["cpu_ms_per_req"]["recorder"] = 1000 * d["cpu_rec"] / n
        if d.get("gen_calls"):
            s["prompts_per_generate"] = d["gen_prompts"] / d["gen_calls"]
        if d.get("timed_calls"):
            s["handler_ms_per_call"] = {t: d[f"time_us.{t}"] / 1000 / d["timed_calls"] for t in TIME_KEYS}
        if d.get("wal_fsyncs"):
            s["wal"] = {"calls_per_fsync": d["wal_appends"] / d["wal_fsyncs"],
                        "append_ms_per_fsync": d["time_us.wal_append"] / 1000 / d["wal_fsyncs"],
                        "entry_wait_ms": d["time_us.wal_entry_wait"] / 1000 / max(d["wal_appends"], 1)}
        s["rounds"] = r["rounds"]
        summary["phases"][f"{name} c{conc}"] = s

    def row(name: str, conc: int) -> str:
        s = summary["phases"][f"{name} c{conc}"]
        c = s["cpu_ms_per_req"]
        batch = f"{s['prompts_per_generate']:7.1f}" if "prompts_per_generate" in s else f"{'':7}"
        rec = f"{c['recorder']:9.2f}" if "recorder" in c else f"{'-':>9}"
        return (f"{conc:>4}  {name:<20}{s['req_per_s']:9.1f}{s['p50_ms']:9.2f}{s['p99_ms']:9.2f}{batch}"
                f"{c['upstream']:11.2f}{rec}{c['load']:7.2f}{s['others_cores']:8.2f}")

    recorders = [n for n in phases if n.startswith("recorder")]
    print()
    print(f"openai.AsyncOpenAI ({args.http}), closed loop, {args.rounds} rounds x {args.seconds:g} s per phase, "
          f"phases interleaved ABAB; {os.cpu_count()} CPUs{', pinned' if args.pin else ''}; "
          f"max_tokens {args.max_tokens}")
    head = (f"{'conc':>4}  {'phase':<20}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'batch':>7}"
            f"   CPU ms/req: upstream recorder load  others (cores)")
    print(head)
    for conc in args.concurrency:
        for name in ("direct", *recorders):
            print(row(name, conc))
    print()
    print(f"goals: throughput recorder/direct >= {GOAL_RATIO}, added p50 <= {GOAL_ADDED_P50_MS:g} ms "
          f"(per-round min..max in brackets)")
    all_pass = True
    for conc in args.concurrency:
        d = summary["phases"][f"direct c{conc}"]
        for name in recorders:
            s = summary["phases"][f"{name} c{conc}"]
            ratio, added = s["req_per_s"] / d["req_per_s"], s["p50_ms"] - d["p50_ms"]
            rr = [a["req_per_s"] / b["req_per_s"] for a, b in zip(s["rounds"], d["rounds"])]
            ra = [1000 * (a["p50"] - b["p50"]) for a, b in zip(s["rounds"], d["rounds"])]
            ok_r, ok_a = ratio >= GOAL_RATIO, added <= GOAL_ADDED_P50_MS
            if name == "recorder":
                all_pass &= ok_r and ok_a
            summary["goals"][f"{name} c{conc}"] = {
                "throughput_ratio": ratio, "added_p50_ms": added, "added_p99_ms": s["p99_ms"] - d["p99_ms"],
                "added_mean_ms": s["mean_ms"] - d["mean_ms"], "ratio_pass": ok_r, "added_p50_pass": ok_a,
                "round_ratios": rr, "round_added_p50_ms": ra}
            print(f"{conc:>4}  {name:<17} throughput x{ratio:.3f} {'PASS' if ok_r else 'MISS'} "
                  f"[{min(rr):.3f}..{max(rr):.3f}]   added p50 {added:+.2f} ms {'PASS' if ok_a else 'MISS'} "
                  f"[{min(ra):+.2f}..{max(ra):+.2f}]   added p99 {s['p99_ms'] - d['p99_ms']:+.2f} ms")
    summary["all_goals_pass"] = all_pass
    print(f"all goals: {'PASS' if all_pass else 'MISS'}")

    print()
    print("where the recorder's time goes, mean ms per call (its time_us.* counters / timed_calls):")
    print(f"{'conc':>4}  {'phase':<20}{'before':>8}{'upstrm':>8}{'after':>8}{'commit':>8}{'own':>7}"
          f"{'client':>8}{'direct':>8}{'added':>7}{'up-dir':>8}{'rest':>7}"
          f"   WAL: calls/fsync, append ms/fsync, entry wait ms")
    for conc in args.concurrency:
        for name in [n for n in phases if not n.startswith("direct") and n != "instant"]:
            s = summary["phases"][f"{name} c{conc}"]
            h = s.get("handler_ms_per_call")
            if not h:
                print(f"{conc:>4}  {name:<20}(no time_us counters)")
                continue
            ref = summary["phases"][f"{'instant' if name.startswith('instant') else 'direct'} c{conc}"]
            own = h["before_upstream"] + h["after_upstream"] + h["commit_wait"]
            added = s["mean_ms"] - ref["mean_ms"]
            up_extra = h["upstream"] - ref["mean_ms"]  # the upstream's cost of the fields, the 2nd hop's client side
            rest = added - own - up_extra
            w = s.get("wal", {})
            wal = (f"{w['calls_per_fsync']:.1f}, {w['append_ms_per_fsync']:.2f}, {w['entry_wait_ms']:.2f}"
                   if w else "-")
            summary["time_split_ms"][f"{name} c{conc}"] = {**h, "own": own, "client_mean": s["mean_ms"],
                                                           "reference_mean": ref["mean_ms"], "added_mean": added,
                                                           "upstream_minus_reference": up_extra, "rest": rest,
                                                           "wal": w}
            print(f"{conc:>4}  {name:<20}{h['before_upstream']:8.3f}{h['upstream']:8.2f}{h['after_upstream']:8.3f}"
                  f"{h['commit_wait']:8.3f}{own:7.2f}{s['mean_ms']:8.2f}{ref['mean_ms']:8.2f}{added:+7.2f}"
                  f"{up_extra:+8.2f}{rest:+7.2f}   {wal}")
    print("  before/after/commit: in the handler before the upstream request, parsing + recording + rewriting "
          "the answer, waiting for the WAL group fsync; own = their sum;")
    print("  client/direct: mean latency seen by the client through the recorder / straight to the upstream "
          "(instant+rec: to the instant upstream); added = client - direct;")
    print("  up-dir = the recorder's wait for the upstream - direct (the recording fields' cost upstream, the "
          "second hop); rest = added - own - up-dir (uvicorn, sockets, the scheduling of shared cores)")

    if "instant" in phases:
        print()
        print("the proxy's own ceiling (an instant upstream replaying a recorded answer):")
        print(head.replace("upstream", "instant "))
        for conc in args.concurrency:
            for name in [n for n in phases if n.startswith("instant")]:
                print(row(name, conc))
        for conc in args.concurrency:
            a, b = summary["phases"][f"instant c{conc}"], summary["phases"][f"instant+rec c{conc}"]
            print(f"{conc:>4}  instant -> through the recorder: x{b['req_per_s'] / a['req_per_s']:.3f} req/s, "
                  f"p50 {b['p50_ms'] - a['p50_ms']:+.2f} ms, recorder CPU {b['cpu_ms_per_req']['recorder']:.2f} ms/call")
    summary["recorder_counters"] = {k: v for k, v in rec_counters.items()
                                    if k in ("recorded_calls", "wal_appends", "wal_fsyncs", "flushed_calls",
                                             "retried_calls", "unrecordable_calls")}
    print("recorder:", summary["recorder_counters"])
    return summary


def serve_canned(port: int, answers_dir: str) -> None:
    """A stand-in upstream that answers every request instantly with a recorded answer: the one with
    the recording fields when the request asks for logprobs, the plain one otherwise."""
    import uvicorn

    full = (Path(answers_dir) / "answer-full.json").read_bytes()
    plain = (Path(answers_dir) / "answer-plain.json").read_bytes()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        data = full if b'"logprobs"' in body else plain
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_canned":
        serve_canned(int(sys.argv[2]), sys.argv[3])
    else:
        main()
