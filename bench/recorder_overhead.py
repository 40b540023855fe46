"""What the recorder costs: latency added and throughput, against calling the upstream directly.

Loopback, one run: ``prodrl serve`` (the tiny lab model, one torch thread) and ``prodrl record`` in
front of it, each its own process (uvicorn with uvloop/httptools); this process drives closed-loop
load at concurrency 32 (httpx, asyncio). Phases are interleaved (ABCABC...) so drift hits all of
them alike:

* ``direct``: the client's request straight to the upstream (completions, token-id prompt,
  ``max_tokens`` 16, no logprobs, unseeded so the server batches);
* ``direct+fields``: the same request with the fields the recorder adds (token ids, 20 top
  logprobs as token-id strings): what the upstream itself pays for recording;
* ``recorder``: the client's request through the recorder (WAL fsync before each answer, Parquet
  flushes in the background).

Reported: p50/p99 latency, requests/s, prompts per engine call and CPU per request of each process
per phase; the targets compare ``recorder`` with ``direct`` (throughput ratio >= 0.9, added p50 <=
2 ms); ``recorder`` vs ``direct+fields`` leaves out what the upstream pays for the recording fields.
On these machines all three processes share 2 CPU cores, so the proxy's CPU time is taken from the
upstream, and the proxy relays a returning batch of answers one after the other, which splits the
local engine's static batches (vLLM batches continuously): both make this comparison pessimistic
for a recorder in front of a GPU server. A last pair of phases replaces the upstream by a process
that answers instantly with a recorded vLLM answer: the proxy's own ceiling (requests/s, latency).

``--compare-src DIR`` adds a phase ``recorder (base)``: the same recorder from another source tree
(e.g. ``mkdir /tmp/base && git archive <rev> prodrl_pipelines | tar -x -C /tmp/base``), in front of
the same upstream, interleaved with the others: before/after figures from one run.

The breakdown printed at the end separates what the upstream pays for the recording fields
(``direct+fields`` vs ``direct``: 20 top logprobs per position and token ids, larger answers) from
the proxy's own cost (``recorder`` vs ``direct+fields``: relaying, parsing, the WAL fsync).

Usage: ``python bench/recorder_overhead.py [--requests 640] [--rounds 3] [--model-dir DIR] [--compare-src DIR]``
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

import aiohttp
import httpx

TOKEN = "bench-token"
PROMPT = [1, 116, 5, 24, 17, 25, 35, 2, 5, 1, 121, 5]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(src: str | None) -> list[str]:
    """The ``prodrl`` command line, from the installed package or from the source tree ``src``."""
    if src is None:
        return [sys.executable, "-m", "prodrl_pipelines.cli"]
    launcher = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in "
                "str(getattr(f, '__module__', '')) + repr(f)]; sys.path.insert(0, sys.argv.pop(1)); "
                "from prodrl_pipelines.cli import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", launcher, str(Path(src).resolve())]


def spawn(args: list[str], port: int, env: dict, headers: dict | None = None, src: str | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([*_cli(src), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", headers=headers, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{args[0]} did not come up")


async def load(url: str, body: dict, n: int, concurrency: int, headers: dict) -> tuple[list[float], float]:
    """Closed loop: ``concurrency`` workers send ``n`` requests in all; latencies and wall time.
    aiohttp: httpx's client costs ~4 ms of CPU per request here, which the servers would lose."""
    lat: list[float] = []
    todo = iter(range(n))
    payload = json.dumps(body).encode()
    hdrs = {**headers, "Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url + "/", headers=hdrs, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as c:
        async def worker():
            for _ in todo:
                t = time.perf_counter()
                async with c.post("v1/completions", data=payload) as r:
                    text = await r.read()
                lat.append(time.perf_counter() - t)
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {text[:300]!r}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return lat, time.perf_counter() - t0


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process to ``cpus``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=640, help="requests per phase and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model-dir", default=None, help="checkpoint to serve (default: build the tiny lab model)")
    ap.add_argument("--batch-wait-ms", type=float, default=10.0, help="the upstream's longest batching wait")
    ap.add_argument("--batch-quiet-ms", type=float, default=1.0, help="the upstream's quiet gap closing a batch")
    ap.add_argument("--pin", action="store_true",
                    help="upstream on CPU 0, recorder and load generator on CPU 1 (the upstream stands in "
                         "for a GPU server: the recorder's CPU time is not taken from it)")
    ap.add_argument("--compare-src", default=None,
                    help="source tree of another prodrl_pipelines (e.g. the previous commit's): adds 'recorder (base)'")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="recorder-bench-"))
    model_dir = args.model_dir
    if model_dir is None:
        from prodrl_pipelines.lab.warmstart import build_base_policy

        model_dir = str(build_base_policy(tmp / "model", size="tiny", sft_steps=5, progress=False))
    env = {**os.environ, "PRODRL_RECORDER_TOKEN": TOKEN, "TOKENIZERS_PARALLELISM": "false"}
    up_port, rec_port = free_port(), free_port()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    procs = []
    try:
        procs.append(spawn(["serve", model_dir, "--port", str(up_port), "--served-model-name", "bench-v0",
                            "--threads", "1", "--batch-wait-ms", str(args.batch_wait_ms),
                            "--batch-quiet-ms", str(args.batch_quiet_ms)], up_port, env))
        procs.append(spawn(["record", "--upstream", f"http://127.0.0.1:{up_port}", "--store", str(tmp / "store"),
                            "--port", str(rec_port), "--tokenizer", model_dir], rec_port, env, auth))
        base_port = free_port()
        if args.compare_src:
            procs.append(spawn(["record", "--upstream", f"http://127.0.0.1:{up_port}", "--store",
                                str(tmp / "store-base"), "--port", str(base_port), "--tokenizer", model_dir],
                               base_port, env, auth, src=args.compare_src))
        if args.pin:
            pin(procs[0].pid, {0})
            for p in procs[1:]:
                pin(p.pid, {1})
            os.sched_setaffinity(0, {1})
        base = {"prompt": PROMPT, "max_tokens": args.max_tokens}
        fields = {**base, "return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": 20,
                  "temperature": 1.0, "top_p": 1.0, "top_k": -1}
        phases = {
            "direct": (f"http://127.0.0.1:{up_port}", base, {}),
            "direct+fields": (f"http://127.0.0.1:{up_port}", fields, {}),
            "recorder": (f"http://127.0.0.1:{rec_port}", base, auth),
        }
        rec_pid = {"recorder": procs[1].pid}
        if args.compare_src:
            phases["recorder (base)"] = (f"http://127.0.0.1:{base_port}", base, auth)
            rec_pid["recorder (base)"] = procs[2].pid
        for url, body, headers in phases.values():  # warm up connections, caches, the engine
            asyncio.run(load(url, body, args.concurrency * 2, args.concurrency, headers))
        results = {name: {"lat": [], "wall": 0.0, "n": 0, "cpu_up": 0.0, "cpu_rec": 0.0, "cpu_load": 0.0,
                          "gen_calls": 0, "gen_prompts": 0, "time_us": {}} for name in phases}

        def rec_times(port: int) -> dict:
            c = httpx.get(f"http://127.0.0.1:{port}/stats", headers=auth).json()["counters"]
            return {k: v for k, v in c.items() if k.startswith("time_us.") or k in ("timed_calls", "wal_fsyncs",
                                                                                      "wal_appends")}
        up_stats = lambda: httpx.get(f"http://127.0.0.1:{up_port}/stats").json()  # noqa: E731
        for _ in range(args.rounds):
            for name, (url, body, headers) in phases.items():
                rpid = rec_pid.get(name, procs[1].pid)
                c_up, c_rec, c_load = cpu_seconds(procs[0].pid), cpu_seconds(rpid), time.process_time()
                u0 = up_stats()
                t0 = rec_times(rec_port) if name == "recorder" else {}
                lat, wall = asyncio.run(load(url, body, args.requests, args.concurrency, headers))
                u1 = up_stats()
                if name == "recorder":
                    for k, v in rec_times(rec_port).items():
                        results[name]["time_us"][k] = results[name]["time_us"].get(k, 0) + v - t0.get(k, 0)
                r = results[name]
                r["gen_calls"] += u1["generate_calls"] - u0["generate_calls"]
                r["gen_prompts"] += u1["prompts"] - u0["prompts"]
                r["lat"] += lat
                r["wall"] += wall
                r["n"] += len(lat)
                r["cpu_up"] += cpu_seconds(procs[0].pid) - c_up
                r["cpu_rec"] += cpu_seconds(rpid) - c_rec
                r["cpu_load"] += time.process_time() - c_load
        stats = httpx.get(f"http://127.0.0.1:{rec_port}/stats", headers=auth).json()["counters"]
        # the proxy alone: an instant upstream replaying a recorded answer
        answer = httpx.post(f"http://127.0.0.1:{up_port}/v1/completions", json=fields, timeout=60).content
        (tmp / "answer.json").write_bytes(answer)
        canned_port, rec2_port = free_port(), free_port()
        procs.append(subprocess.Popen([sys.executable, __file__, "--_canned", str(canned_port), str(tmp / "answer.json")],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        procs.append(spawn(["record", "--upstream", f"http://127.0.0.1:{canned_port}", "--store",
                            str(tmp / "store2"), "--port", str(rec2_port), "--tokenizer", model_dir], rec2_port, env, auth))
        canned = {"instant upstream": (f"http://127.0.0.1:{canned_port}", base, {}, procs[-1].pid),
                  "its recorder": (f"http://127.0.0.1:{rec2_port}", base, auth, procs[-1].pid)}
        if args.compare_src:
            rec3_port = free_port()
            procs.append(spawn(["record", "--upstream", f"http://127.0.0.1:{canned_port}", "--store",
                                str(tmp / "store3"), "--port", str(rec3_port), "--tokenizer", model_dir], rec3_port,
                               env, auth, src=args.compare_src))
            canned["its recorder (base)"] = (f"http://127.0.0.1:{rec3_port}", base, auth, procs[-1].pid)
        for name, (url, body, headers, pid) in canned.items():
            asyncio.run(load(url, body, args.concurrency * 4, args.concurrency, headers))
            c_rec = cpu_seconds(pid)
            lat, wall = asyncio.run(load(url, body, args.requests * args.rounds, args.concurrency, headers))
            results[name] = {"lat": lat, "wall": wall, "n": len(lat), "cpu_rec": cpu_seconds(pid) - c_rec}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    summary = {}
    proxy_alone = [n for n in ("instant upstream", "its recorder", "its recorder (base)") if n in results]
    for name in proxy_alone:
        r = results.pop(name)
        summary[name] = {"p50_ms": 1000 * pct(r["lat"], 0.5), "p99_ms": 1000 * pct(r["lat"], 0.99),
                         "req_per_s": r["n"] / r["wall"], "recorder_cpu_ms_per_req": 1000 * r["cpu_rec"] / r["n"]}
    for name, r in results.items():
        times = r.pop("time_us", {})
        summary[name] = {"p50_ms": 1000 * pct(r["lat"], 0.5), "p99_ms": 1000 * pct(r["lat"], 0.99),
                         "mean_ms": 1000 * statistics.fmean(r["lat"]), "req_per_s": r["n"] / r["wall"],
                         "upstream_prompts_per_generate": r["gen_prompts"] / max(r["gen_calls"], 1),
                         "cpu_ms_per_req": {"upstream": 1000 * r["cpu_up"] / r["n"],
                                            "recorder": 1000 * r["cpu_rec"] / r["n"],
                                            "load": 1000 * r["cpu_load"] / r["n"]}}
        if times.get("wal_fsyncs"):
            summary[name]["wal"] = {"entries_per_fsync": times["wal_appends"] / times["wal_fsyncs"],
                                    "append_ms": times.get("time_us.wal_append", 0) / 1000 / times["wal_fsyncs"],
                                    "entry_wait_ms": times.get("time_us.wal_entry_wait", 0) / 1000
                                    / max(times["wal_appends"], 1)}
        if times.get("timed_calls"):
            summary[name]["handler_ms_per_call"] = {k[len("time_us."):]: v / 1000 / times["timed_calls"]
                                                    for k, v in times.items()
                                                    if k.startswith("time_us.") and not k.startswith("time_us.wal")}
    d, f, rec = summary["direct"], summary["direct+fields"], summary["recorder"]
    summary["ratios"] = {
        "throughput_recorder_vs_direct": rec["req_per_s"] / d["req_per_s"],
        "added_p50_ms_vs_direct": rec["p50_ms"] - d["p50_ms"],
        "added_p99_ms_vs_direct": rec["p99_ms"] - d["p99_ms"],
        "throughput_recorder_vs_direct_fields": rec["req_per_s"] / f["req_per_s"],
        "added_p50_ms_vs_direct_fields": rec["p50_ms"] - f["p50_ms"],
    }
    summary["recorder_counters"] = {k: v for k, v in stats.items()
                                    if k in ("recorded_calls", "wal_appends", "wal_fsyncs", "flushed_calls")}
    summary["setup"] = {"concurrency": args.concurrency, "requests_per_phase": args.requests * args.rounds,
                        "max_tokens": args.max_tokens, "cpus": os.cpu_count(), "pinned": args.pin,
                        "upstream_batch_wait_ms": args.batch_wait_ms, "upstream_batch_quiet_ms": args.batch_quiet_ms}
    print(f"{'phase':<17}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'batch':>7}   CPU ms/request: upstream recorder load")
    for name in phases:
        s = summary[name]
        c = s["cpu_ms_per_req"]
        print(f"{name:<17}{s['p50_ms']:9.2f}{s['p99_ms']:9.2f}{s['req_per_s']:9.1f}"
              f"{s['upstream_prompts_per_generate']:7.1f}{c['upstream']:22.2f}{c['recorder']:9.2f}{c['load']:6.2f}")
    r = summary["ratios"]
    print(f"recorder vs direct: throughput x{r['throughput_recorder_vs_direct']:.3f} (target >= 0.9), "
          f"p50 {r['added_p50_ms_vs_direct']:+.2f} ms (target <= 2), p99 {r['added_p99_ms_vs_direct']:+.2f} ms")
    print(f"breakdown: the upstream's cost of the recording fields (direct+fields vs direct): throughput "
          f"x{f['req_per_s'] / d['req_per_s']:.3f}, p50 {f['p50_ms'] - d['p50_ms']:+.2f} ms; "
          f"the proxy's own cost (recorder vs direct+fields): throughput x{r['throughput_recorder_vs_direct_fields']:.3f}, "
          f"p50 {r['added_p50_ms_vs_direct_fields']:+.2f} ms, recorder CPU {rec['cpu_ms_per_req']['recorder']:.2f} ms/call")
    h = rec.get("handler_ms_per_call")
    if h:
        inside = h["before_upstream"] + h["after_upstream"] + h["commit_wait"]
        print(f"recorder handler, mean ms per call: waiting for the upstream {h['upstream']:.2f}; its own "
              f"{inside:.2f} = before the upstream request {h['before_upstream']:.2f} + parsing/recording/rewriting "
              f"{h['after_upstream']:.2f} + WAL fsync wait {h['commit_wait']:.2f}; the client's mean latency "
              f"{rec['mean_ms']:.2f} (the rest: uvicorn, sockets, the client)")
        w = summary["recorder"].get("wal", {})
        if w:
            print(f"  WAL: {w['entries_per_fsync']:.1f} calls per fsync group, encode+write+fdatasync "
                  f"{w['append_ms']:.2f} ms per group, an entry waits {w['entry_wait_ms']:.2f} ms to be durable; "
                  f"the rest of the fsync wait is the event loop resuming the handler")
    if "recorder (base)" in summary:
        b = summary["recorder (base)"]
        summary["ratios"]["throughput_recorder_vs_base"] = rec["req_per_s"] / b["req_per_s"]
        print(f"recorder vs recorder (base): throughput x{rec['req_per_s'] / b['req_per_s']:.3f}, p50 "
              f"{rec['p50_ms'] - b['p50_ms']:+.2f} ms, recorder CPU {b['cpu_ms_per_req']['recorder']:.2f} -> "
              f"{rec['cpu_ms_per_req']['recorder']:.2f} ms/call")
    print("recorder:", summary["recorder_counters"])
    a, b = summary["instant upstream"], summary["its recorder"]
    print(f"proxy alone (instant upstream): {a['req_per_s']:.0f} -> {b['req_per_s']:.0f} req/s, p50 {a['p50_ms']:.2f} -> "
          f"{b['p50_ms']:.2f} ms, p99 {a['p99_ms']:.2f} -> {b['p99_ms']:.2f} ms, recorder CPU "
          f"{b['recorder_cpu_ms_per_req']:.2f} ms/request")
    if "its recorder (base)" in summary:
        c = summary["its recorder (base)"]
        print(f"  base recorder, same instant upstream: {c['req_per_s']:.0f} req/s, p50 {c['p50_ms']:.2f} ms, "
              f"p99 {c['p99_ms']:.2f} ms, recorder CPU {c['recorder_cpu_ms_per_req']:.2f} ms/request")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


def serve_canned(port: int, path: str) -> None:
    """A stand-in upstream that answers every request instantly with the bytes in ``path``."""
    import uvicorn

    data = Path(path).read_bytes()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_canned":
        serve_canned(int(sys.argv[2]), sys.argv[3])
    else:
        main()
