"""Prefix-cache hits with and without session affinity: ``agent_traffic``'s ``prefix-cache hit
sticky/least-requests``, also runnable alone (``python bench/_prefix_cache.py``).

Two vLLM replicas (``--replicas``) of one dense lab policy (prefix caching on, 32-token blocks; dev
mode for ``/reset_prefix_cache``; each bound to a core, the cores in turn), listed in one endpoint
file; one recorder following it with ``chat_history: extend`` (a session's prompt is its previous
call's prompt and output, exactly), and the same multi-turn chat workload sent twice: with the
recorder's session affinity (a session's call goes to the replica that served its last one) and
without (``--no-session-affinity``: every call to the least loaded replica). Each session opens with
its own question, so sessions share no full block. The hit rate is vLLM's own counters summed over
the replicas, ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` (prompt tokens),
every cache reset before each phase; the phases alternate over ``rounds``.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vllm import SERVER_ARGS, dense_exports  # noqa: E402

from prodrl_pipelines.deploy_targets.base import Endpoint, wait_healthy  # noqa: E402
from prodrl_pipelines.deploy_targets.endpoint_store import open_endpoint  # noqa: E402
from prodrl_pipelines.deploy_targets.processes import pick_port  # noqa: E402
from prodrl_pipelines.deploy_targets.server_records import stop_process_group  # noqa: E402
from prodrl_pipelines.engines.server import BackgroundServer  # noqa: E402
from prodrl_pipelines.engines.vllm_client import vllm_serve_command, vllm_serve_env  # noqa: E402
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app  # noqa: E402

TOKEN = "bench-token"
NAME = "policy"
CACHE_ARGS = ("--enable-prefix-caching", "--block-size", "32")


def _counters(url: str) -> tuple[float, float]:
    """(prefix-cache hits, queries) in prompt tokens, from a replica's /metrics."""
    text = httpx.get(url + "/metrics", timeout=60).text

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("prefix_cache_hits"), total("prefix_cache_queries")


def _session(client: openai.OpenAI, sid: str, i: int, turns: int, max_tokens: int, think_s: float) -> int:
    """One multi-turn chat session; the calls it made (a call past the model's length ends it).
    Each answer has a length of its own (up to ``max_tokens``, the same in both phases) and a "tool"
    runs between turns (exponential, mean ``think_s``): with equal lengths and no pause, a batch's
    sessions all finish together and come straight back to the replica that just emptied, a lockstep
    that makes least-requests look sticky and that real agents' varied turns break."""
    rng = random.Random(f"prefix_cache:{i}")
    # an opening of its own (a few blocks' worth), so that no full block is another session's
    opening = " ".join(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}" for _ in range(12))
    messages = [{"role": "user", "content": opening + "?"}]
    for t in range(turns):
        n = rng.randint(max(1, max_tokens // 4), max_tokens)
        try:  # each answer its full length: the history grows by the same tokens in both phases
            # unseeded: vLLM 0.32's CPU build kills its engine when a seeded request's prefill is
            # chunked ("CPU Generator does not use offset"), which 16 sessions at once make happen
            r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=n,
                                               temperature=1.0, extra_body={"min_tokens": n},
                                               extra_headers={"X-Session-Id": sid})
        except openai.BadRequestError:  # the conversation outgrew the model's positions
            return t
        time.sleep(rng.expovariate(1.0 / think_s))
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"then {rng.choice('+-')}{rng.randint(1, 9)}"}]
    return turns


def _routes_of(balancer) -> dict[str, list[str]]:
    """The replica each session's calls went to, in order (the balancer's picks, watched)."""
    routes: dict[str, list[str]] = {}
    pick = balancer.pick

    def watched(endpoint, trajectory_id, exclude=frozenset()):
        choice = pick(endpoint, trajectory_id, exclude)
        if choice is not None and trajectory_id:
            routes.setdefault(trajectory_id, []).append(choice.url)
        return choice

    balancer.pick = watched
    return routes


def hit_rates(python: str, work: Path, sessions: int = 16, turns: int = 4, concurrency: int = 16,
              rounds: int = 1, max_tokens: int = 24, think_s: float = 1.0, replicas: int = 2,
              log=print) -> dict[str, float]:
    """{"sticky": hit rate, "least-requests": hit rate, "calls": calls per phase}; ``python``: vLLM's."""
    export = dense_exports(work / "policy", 1)[0]
    servers = []
    try:
        for k in range(replicas):
            port = pick_port()
            # a core of its own each, as two machines would have (both on every core, their OpenMP
            # threads fight and one replica runs ahead: least-requests then sends it most calls)
            env = {**vllm_serve_env("127.0.0.1"), "VLLM_SERVER_DEV_MODE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": str(k % (os.cpu_count() or 1))}
            cmd = vllm_serve_command(export, port, 20, served_model_name=NAME, python=python,
                                     extra_args=SERVER_ARGS + CACHE_ARGS)
            with open(work / f"vllm{k}.log", "ab") as fh:
                proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            servers.append((proc, f"http://127.0.0.1:{port}"))
        t0 = time.monotonic()
        for proc, url in servers:
            wait_healthy(url, 300, expect_model=NAME, alive=lambda p=proc: p.poll() is None)
        log(f"prefix cache: {replicas} vLLM replicas up in {time.monotonic() - t0:.0f} s")
        urls = [u for _, u in servers]
        follow = work / "endpoint.json"
        open_endpoint(str(follow)).write(Endpoint(urls[0], NAME, "v1", replicas=[
            {"url": u, "served_model_name": NAME, "policy_version": "v1"} for u in urls]))
        sums = {"sticky": [0.0, 0.0], "least-requests": [0.0, 0.0]}
        calls = 0
        for r in range(rounds):
            for phase in ("least-requests", "sticky") if r % 2 == 0 else ("sticky", "least-requests"):
                for u in urls:  # what the other phase cached must not count for this one
                    httpx.post(u + "/reset_prefix_cache", timeout=60).raise_for_status()
                before = [_counters(u) for u in urls]
                cfg = RecorderConfig(upstream="", follow=str(follow), store_dir=str(work / f"store-{phase}-{r}"),
                                     token=TOKEN, tokenizer_dir=str(export), chat_history="extend",
                                     session_affinity=phase == "sticky")
                app = build_recorder_app(cfg)
                routes = _routes_of(app.state.recorder.balancer)
                with BackgroundServer(app) as rec:
                    client = openai.OpenAI(base_url=rec.url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
                    with ThreadPoolExecutor(concurrency) as pool:
                        made = list(pool.map(lambda i: _session(client, f"{phase}-{r}-{i}", i, turns, max_tokens, think_s),
                                             range(sessions)))
                after = [_counters(u) for u in urls]
                hits = sum(a[0] - b[0] for a, b in zip(after, before))
                queries = sum(a[1] - b[1] for a, b in zip(after, before))
                sums[phase][0] += hits
                sums[phase][1] += queries
                calls = sum(made)
                pairs = [(a, b) for urls_of in routes.values() for a, b in zip(urls_of, urls_of[1:])]
                kept = sum(a == b for a, b in pairs) / max(len(pairs), 1)
                share = max(sum(u == url for us in routes.values() for u in us) for url in urls) / max(sum(made), 1)
                log(f"prefix cache, {phase:14s} round {r}: {sum(made)} calls, {hits:.0f} of {queries:.0f} prompt "
                    f"tokens hit ({hits / max(queries, 1):.2f}); a session's next call on its last replica: {kept:.2f}; "
                    f"calls on the busier replica: {share:.2f}")
        out = {k: h / max(q, 1.0) for k, (h, q) in sums.items()}
        out["calls"] = calls
        return out
    finally:
        for proc, _ in servers:
            stop_process_group(proc.pid)


if __name__ == "__main__":
    import argparse

    from prodrl_pipelines.config import environment

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", nargs="?", help="a directory whose logs are kept (default: a temporary one)")
    ap.add_argument("--replicas", type=int, default=2, help="vLLM replicas (bound to the cores in turn)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(a.work or d)
        work.mkdir(parents=True, exist_ok=True)
        rates = hit_rates(environment.vllm_python(), work, rounds=2, replicas=a.replicas)
    print(f"prefix-cache hit sticky/least-requests={rates['sticky']:.2f}/{rates['least-requests']:.2f}")
