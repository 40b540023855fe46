"""Agent SDK traffic through the recorder: how often an episode trains as one sequence, and what
streaming costs the recorder (issue 37's benchmark), side by side in one run.

    python bench/agent_traffic.py [--episodes 24] [--seconds 5] [--rounds 3] [--policy-dir DIR] [--smoke]

The policy is the lab's tools policy (tests/conftest.py's ``tools_policy_dir``: ``arithmetic_tools``
warm-started on the agent loop, seeded; built here in a temporary directory unless ``--policy-dir``),
served by ``prodrl serve --reply-parser qwen3`` (its own process, one torch thread) under chat
templates that mimic production rules in the lab's tokens (``--templates``, default all):
``qwen3``, the policy's own (``production_text.QWEN3_STYLE_TOOLS_TEMPLATE``: earlier reasoning
dropped, calls re-serialised by the template); and copies of the policy dir whose
``chat_template.jinja`` is ``production_text``'s ``llama32`` (Llama 3.2: a dated system header,
calls re-serialised as ``{"name", "parameters"}`` JSON, reasoning dropped), ``glm45`` (GLM-4.5:
calls re-serialised as ``<arg_key>``/``<arg_value>`` pairs, earlier reasoning dropped) or
``qwen3-nothink`` (Qwen3 with ``enable_thinking=False``: an empty reasoning block in every
generation prompt, none in history).

1. **merged/multi-call**, per cell (SDK x template x ``chat_history``): ``--episodes`` two-question
   ``add``-tool episodes (``lab.sdk_agents``: openai-agents in chat mode and in its default
   Responses mode (streamed), pydantic-ai, a streamed
   LangGraph ReAct agent over langchain-openai, the official anthropic client on the Messages API; episode ``i`` seeded ``SEED + i``, its questions drawn
   from ``i``), each one trajectory, through a recorder of its own (``extend`` or ``rerender``) in
   front of the template's server; the fraction of multi-call trajectories that the trainer's layout
   merges whole into one training sequence, from ``rl.merge_report.merge_report`` over the recorder's
   store. Per cell it prints the layout's split reasons, the extend counters (``extend_bridged``,
   ``extend_rendered.<reason>``), episodes that failed, and episodes where the policy did not call the
   tool exactly once per question; then the table. In the last line, ``merged/multi-call`` is each
   SDK's with ``extend`` on ``qwen3``; ``extend/rerender`` is openai-agents' on each template
   (X = extend, Y = rerender).
3. **recorder/direct streaming c=8**: 8 concurrent clients (closed loop, ``openai.AsyncOpenAI``), each
   sending an agent's first call (a question, the ``add`` tool, temperature 0.5, unseeded so that the
   server batches, ``max_tokens`` 64) for ``--seconds`` per phase, directly to ``prodrl serve`` and
   through ``prodrl record`` (rerender, its own process; one ``X-Trajectory-Id`` per worker). Three
   kinds, interleaved over ``--rounds`` (each round: per kind, direct then recorder): chat streamed
   (``stream_options.include_usage``), chat not streamed, plain ``/v1/completions`` of the same
   rendered prompt, and streamed chat through a second recorder with ``--chat-history extend`` (it
   renders the call itself and asks the upstream for a completion of ids). Requests/s ratio recorder/direct per kind, over all rounds; the CPU ms per request
   of the server and the recorder, and the recorder's handler time per call (``time_us.*``).

4. **unrecordable-in-extend**: greedy, penalised, ``min_p``, ``logit_bias`` and JSON-output chat calls
   sent in a session through both recorders; the number recorded as trainable (goal: 0).

5. **prefix-cache hit sticky/least-requests** (bench/_prefix_cache.py): ``--prefix-cache-replicas``
   vLLM replicas (4; each bound to a core, the cores in turn) with prefix caching behind one
   extending recorder, 16 multi-turn sessions at once (a pause between
   turns, as an agent's tool takes), with the recorder's session affinity and without; the fraction of
   prompt tokens vLLM's counters found cached, summed over the replicas. Needs the vLLM environment;
   not run at smoke size (four vLLM start-ups), where the value is ``not-run``.

Goals: every SDK >= 0.95 merged with ``extend`` on every template; the streamed ratio no worse than
plain completions' (also compared with non-streamed chat's); no unrecordable call recorded as
trainable in either mode; prefix-cache hits sticky >= 1.5x least-requests.

Last line:
``agent_traffic: merged/multi-call openai-agents=X openai-agents-responses=X pydantic-ai=X langgraph=X anthropic=X; extend/rerender qwen3=X/Y [llama32=X/Y glm45=X/Y qwen3-nothink=X/Y]; unrecordable-in-extend=N; prefix-cache hit sticky/least-requests=X/Y; recorder/direct streaming c=8=X; recorder/direct streaming extend c=8=X``
(the templates served: ``--templates``).

Smoke size (``--smoke``, bench/_smoke.py): the tiny tools policy (10 warm-start steps on 64 tasks: it
rarely calls the tool right), ``qwen3`` only, one episode per cell, one round of 0.3 s phases, no
prefix-cache measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recorder_overhead import TIME_KEYS, cpu_seconds, free_port, make_client, run_loop  # noqa: E402
from recorder_overhead import spawn as spawn_prodrl  # noqa: E402
from _smoke import parse_args  # noqa: E402

from prodrl_pipelines.engines.server import BackgroundServer  # noqa: E402
from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app  # noqa: E402
from prodrl_pipelines.rl.merge_report import merge_report  # noqa: E402

TOKEN = "bench-token"
MODEL = "tools-policy"
# tests/conftest.py's TOOLS_POLICY_SFT: the tools policy of the SDK tests
TOOLS_POLICY_SFT = dict(agent_loop=True, steps=150, batch_size=16, n_tasks=2000, format_noise=0.0, compact_noise=0.0)
SDK_NAMES = {"openai-agents": "openai-agents-chat", "openai-agents-responses": "openai-agents-responses",
             "pydantic-ai": "pydantic-ai", "langgraph": "langgraph", "anthropic": "anthropic"}
MAX_TOKENS = 64


def spawn(args: list[str], port: int, env: dict, log: Path, headers: dict | None = None) -> subprocess.Popen:
    """``prodrl ARGS`` in its own process (output to ``log``), once its /health answers."""
    return spawn_prodrl(args, port, env, headers, log=log, timeout_s=180)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# template name -> the production_text template a copy of the policy dir is served with (qwen3: its own)
MIMICS = {"llama32": "LLAMA32_STYLE_TOOLS_TEMPLATE", "glm45": "GLM45_STYLE_TOOLS_TEMPLATE",
          "qwen3-nothink": "QWEN3_NOTHINK_STYLE_TOOLS_TEMPLATE"}


def template_copy(policy: Path, out: Path, name: str) -> Path:
    """The policy dir with the ``name`` mimic (``MIMICS``) as its chat template."""
    from transformers import AutoTokenizer

    from prodrl_pipelines.lab import production_text

    template = getattr(production_text, MIMICS[name])
    shutil.copytree(policy, out)
    (out / "chat_template.jinja").write_text(template)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.pop("chat_template", None) is not None:
        cfg_path.write_text(json.dumps(cfg, indent=2))
    if AutoTokenizer.from_pretrained(out).chat_template != template:
        raise SystemExit(f"{out}: the tokenizer does not load the written chat_template.jinja")
    return out


def questions(i: int) -> tuple[str, str]:
    """Episode ``i``'s two questions, in the arithmetic task's words (``12+7``, ``then -3``)."""
    rng = random.Random(f"agent_traffic:{i}")
    return (f"{rng.randint(0, 9)}{rng.choice('+-')}{rng.randint(0, 9)}",
            f"then {rng.choice('+-')}{rng.randint(1, 9)}")


def run_cell(name: str, upstream: str, tokenizer_dir: Path, store: Path, history: str, sdk: str,
             episodes: int, workers: int = 2) -> dict:
    """``episodes`` episodes of ``sdk`` through a recorder (``history`` mode) in front of ``upstream``:
    the merge report of its store, its counters, and what the episodes did."""
    from prodrl_pipelines.lab.sdk_agents import SDKS, SEED

    cfg = RecorderConfig(upstream=upstream, store_dir=str(store), token=TOKEN, tokenizer_dir=str(tokenizer_dir),
                         chat_history=history, reply_parser="qwen3")
    app = build_recorder_app(cfg)
    rec = app.state.recorder
    failed: list[str] = []
    tool_calls: list[int] = []

    def one(i: int):
        tid = f"{name}-{i}"
        try:
            ep = SDKS[SDK_NAMES[sdk]](srv.url + "/v1", tid, api_key=TOKEN, model=MODEL, questions=questions(i),
                                      seed=SEED + i)
            tool_calls.append(len(ep.executed))
        except Exception as exc:  # counted and shown: the trajectory stays in the store as far as it went
            failed.append(f"{tid}: {type(exc).__name__}: {str(exc)[:160]}")

    t0 = time.monotonic()
    with BackgroundServer(app) as srv:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(episodes)))
        counters = httpx.get(srv.url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"},
                             timeout=30).json()["counters"]
        if not rec.ingestor.flush(60):
            raise RuntimeError(f"{name}: the recorder's rows were not flushed")
        report = merge_report(rec.store)
    seconds = time.monotonic() - t0
    sums = Counter()
    for v in report:
        row = v.as_row()
        for k, val in row.items():
            if isinstance(val, int):
                sums[k] += val
    frac = sums["merged_whole"] / sums["multi_call"] if sums["multi_call"] else float("nan")
    splits = {k.removeprefix("split_"): n for k, n in sums.items() if k.startswith("split_") and n}
    ext = {k: n for k, n in counters.items() if k.startswith("extend_")}
    odd = sum(n != 2 for n in tool_calls)
    print(f"{name:32s} {episodes} episodes in {seconds:5.1f} s: trajectories {sums['trajectories']}, multi-call "
          f"{sums['multi_call']}, merged whole {sums['merged_whole']} ({frac:.2f}), sequences {sums['sequences']}, "
          f"splits {splits or '{}'}, incomplete {sums['incomplete']}; failed {len(failed)}; "
          f"tool calls per episode {sorted(Counter(tool_calls).items())} (not 1 per question: {odd}); "
          f"unrecordable {counters.get('unrecordable_calls', 0)}" + (f"; {ext}" if ext else ""), flush=True)
    for f in failed:
        print(f"    failed {f}")
    return {"frac": frac, "failed": failed, "odd": odd, "splits": splits, "extend": ext, **sums}


# ----------------------------------------------------------------------------- throughput


def agent_request(policy: Path) -> tuple[list[dict], list[dict], str]:
    """An agent's first call: messages, tools, and the prompt the template renders of them."""
    from transformers import AutoTokenizer

    from prodrl_pipelines.lab.arithmetic_tools import ADD_TOOL

    messages = [{"role": "user", "content": "7+5"}]
    tok = AutoTokenizer.from_pretrained(policy)
    prompt = tok.apply_chat_template(messages, tools=[ADD_TOOL], tokenize=False, add_generation_prompt=True)
    return messages, [ADD_TOOL], prompt


async def phase(base_url: str, kind: str, seconds: float, concurrency: int, req: tuple, tid: str | None) -> int:
    """Requests of ``kind`` answered in ``seconds`` by ``concurrency`` closed-loop workers (after a warm-up)."""
    messages, tools, prompt = req
    client = make_client(base_url, TOKEN, concurrency, "aiohttp")
    done = 0

    async def call(w: int) -> None:
        hdrs = {"X-Trajectory-Id": f"{tid}-w{w}"} if tid else None
        common = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0.5, extra_headers=hdrs)
        if kind.startswith("chat streamed"):
            stream = await client.chat.completions.create(messages=messages, tools=tools, stream=True,
                                                          stream_options={"include_usage": True}, **common)
            chunks = [c async for c in stream]
            if not chunks or chunks[-1].usage is None:
                raise RuntimeError("a stream without its usage chunk")
        elif kind == "chat":
            r = await client.chat.completions.create(messages=messages, tools=tools, **common)
            if not r.choices:
                raise RuntimeError(f"an empty answer: {r}")
        else:
            r = await client.completions.create(prompt=prompt, **common)
            if not r.choices:
                raise RuntimeError(f"an empty answer: {r}")

    async def worker(w: int, start: float, end: float) -> None:
        nonlocal done
        while time.perf_counter() < end:
            await call(w)
            if time.perf_counter() >= start:
                done += time.perf_counter() < end

    warm = min(1.0, seconds)  # not counted: the first second (less in a smoke run's short phases)
    async with client:
        await asyncio.gather(*(call(w) for w in range(concurrency)))  # open the connections
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w, t0 + warm, t0 + warm + seconds) for w in range(concurrency)))
    return done


EXTEND_KIND = "chat streamed, extend"


def throughput(up_url: str, rec_urls: dict, policy: Path, seconds: float, rounds: int, pids: dict,
               concurrency: int = 8) -> dict:
    """Requests/s ratio recorder/direct of each kind; per kind also the CPU ms per request of the
    server and the recorder, and where the recorder's handler time goes (its ``time_us.*`` counters).
    ``rec_urls``: the re-rendering recorder (``rerender``) and the extending one (``extend``, for
    ``EXTEND_KIND``: streamed chat whose calls it renders and sends upstream as completions of ids)."""
    req = agent_request(policy)
    kinds = ("chat streamed", "chat", "completions", EXTEND_KIND)

    def rec_of(k: str) -> str:
        return "extend" if k == EXTEND_KIND else "rerender"
    counts = {(k, w): [] for k in kinds for w in ("direct", "recorder")}
    cpu = Counter()  # (kind, who, process) -> CPU seconds
    timed = Counter()  # (kind, counter) -> its increase over the recorder phases

    def counters(rec_url: str) -> dict:
        return httpx.get(rec_url + "/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()["counters"]

    for r in range(rounds):
        for k in kinds:
            rec_url = rec_urls[rec_of(k)]
            for who, url in (("direct", up_url), ("recorder", rec_url)):
                tid = f"load-r{r}-{k.replace(' ', '-').replace(',', '')}" if who == "recorder" else None
                c0, t0 = {n: cpu_seconds(pid) for n, pid in pids.items()}, counters(rec_url)
                counts[(k, who)].append(run_loop(phase(url, k, seconds, concurrency, req, tid)))
                c1, t1 = {n: cpu_seconds(pid) for n, pid in pids.items()}, counters(rec_url)
                for n in pids:
                    cpu[(k, who, n)] += c1[n] - c0[n]
                if who == "recorder":
                    for key in (*(f"time_us.{t}" for t in TIME_KEYS), "timed_calls"):
                        timed[(k, key)] += t1.get(key, 0) - t0.get(key, 0)
        print(f"round {r}: " + ", ".join(f"{k} {counts[(k, 'direct')][-1] / seconds:.1f}/"
                                          f"{counts[(k, 'recorder')][-1] / seconds:.1f}" for k in kinds)
              + " req/s direct/recorder", flush=True)
    out = {}
    for k in kinds:
        d, rr = sum(counts[(k, "direct")]), sum(counts[(k, "recorder")])
        out[k] = rr / d if d else float("nan")
        per_round = [b / a for a, b in zip(counts[(k, "direct")], counts[(k, "recorder")]) if a]
        # CPU per request over the whole phase (warm-up included): a rough share, not an exact cost
        cpu_d = 1000 * cpu[(k, "direct", "serve")] / max(d, 1)
        cpu_r = {n: 1000 * cpu[(k, "recorder", n)] / max(rr, 1) for n in pids}
        calls = timed[(k, "timed_calls")]
        where = (", ".join(f"{t} {timed[(k, f'time_us.{t}')] / 1000 / calls:.2f}" for t in TIME_KEYS) if calls
                 else "(streams are not timed)")
        print(f"{k:21s} c={concurrency}: direct {d / (seconds * rounds):6.1f} req/s, recorder "
              f"{rr / (seconds * rounds):6.1f} req/s, ratio recorder/direct {out[k]:.3f} "
              f"(per round {', '.join(f'{x:.2f}' for x in per_round)}); CPU ms/req: serve {cpu_d:.1f} direct, "
              f"{cpu_r['serve']:.1f} via recorder, recorder {cpu_r['record-' + rec_of(k)]:.1f}; recorder handler ms/call: "
              f"{where}",
              flush=True)
    return out


# calls a recorder must never record as trainable, in either chat_history mode: greedy, penalised,
# constrained, structured output (the upstream may refuse some: a refused call is not recorded either)
UNRECORDABLE = [{"temperature": 0}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.3},
                {"repetition_penalty": 1.2}, {"min_p": 0.1}, {"logit_bias": {"5": 5}},
                {"response_format": {"type": "json_object"}}]


def unrecordable_recorded(rec_urls: dict[str, str]) -> int:
    """How many of the UNRECORDABLE calls, sent in a session to each recorder, were recorded as
    trainable (``X-Prodrl-Recorded: true``): the goal is 0."""
    n = 0
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as h:
        for history, url in rec_urls.items():
            for i, fields in enumerate(UNRECORDABLE):
                r = h.post(url + "/v1/chat/completions", headers={"X-Session-Id": f"unrecordable-{history}-{i}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4,
                                 **fields})
                n += r.headers.get("x-prodrl-recorded") == "true"
    return n


def prefix_cache_part(run: bool, work: Path, replicas: int) -> dict[str, str]:
    """The prefix-cache measure (bench/_prefix_cache.py) as the last line's value and its goal."""
    from prodrl_pipelines.config import environment

    py = environment.vllm_python()
    if not run or py is None or not Path(py).exists():
        why = "not run (smoke size)" if not run else "not run (no vLLM environment)"
        return {"value": "not-run", "goal": f"prefix-cache hits sticky >= 1.5x least-requests: {why}"}
    from _prefix_cache import hit_rates

    work.mkdir(parents=True, exist_ok=True)
    rates = hit_rates(py, work, rounds=2, replicas=replicas, log=lambda m: print(m, flush=True))
    st, lr = rates["sticky"], rates["least-requests"]
    return {"value": f"{st:.2f}/{lr:.2f}", "goal": f"prefix-cache hits sticky >= 1.5x least-requests "
                                                   f"({st:.2f} vs {lr:.2f}): {'PASS' if st >= 1.5 * lr else 'MISS'}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=24, help="episodes per cell (SDK, template, history mode)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput phase and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of interleaved throughput phases")
    ap.add_argument("--policy-dir", default=None, help="the tools policy (default: build it, ~20 s)")
    ap.add_argument("--templates", nargs="+", default=["qwen3", *MIMICS], choices=["qwen3", *MIMICS],
                    help="chat templates to serve the policy with (qwen3, its own, is always served)")
    ap.add_argument("--policy-size", default="demo", help="lab size of the tools policy built")
    ap.add_argument("--sft-steps", type=int, default=TOOLS_POLICY_SFT["steps"], help="its warm start")
    ap.add_argument("--sft-tasks", type=int, default=TOOLS_POLICY_SFT["n_tasks"], help="its demonstrated tasks")
    ap.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="measure prefix-cache hits, sticky versus least-requests, on vLLM replicas")
    ap.add_argument("--prefix-cache-replicas", type=int, default=4, help="vLLM replicas of that measure")
    args = parse_args(ap, episodes=1, seconds=0.3, rounds=1, templates=["qwen3"], policy_size="tiny", sft_steps=10,
                      sft_tasks=64, prefix_cache=False)
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="agent-traffic-"))
    procs: list[subprocess.Popen] = []
    try:
        if args.policy_dir:
            policy = Path(args.policy_dir)
        else:
            from prodrl_pipelines.lab.warmstart import build_base_policy

            t = time.monotonic()
            policy = build_base_policy(tmp / "qwen3", size=args.policy_size, seed=0, progress=False,
                                       task="arithmetic_tools", sft={**TOOLS_POLICY_SFT, "steps": args.sft_steps,
                                                                  "n_tasks": args.sft_tasks})
            print(f"tools policy built in {time.monotonic() - t:.1f} s", flush=True)
        dirs = {"qwen3": Path(policy), **{t: template_copy(Path(policy), tmp / t, t) for t in MIMICS
                                          if t in args.templates}}
        env = {**os.environ, "PRODRL_RECORDER_TOKEN": TOKEN, "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": "1"}
        ups = {}
        for name, d in dirs.items():
            port = free_port()
            procs.append(spawn(["serve", str(d), "--port", str(port), "--served-model-name", MODEL, "--threads", "1",
                                "--reply-parser", "qwen3", "--batch-wait-ms", "5"], port, env, tmp / f"serve-{name}.log"))
            ups[name] = f"http://127.0.0.1:{port}"
        print(f"prodrl serve up: {ups}", flush=True)

        cells = {}
        for tpl in dirs:
            for sdk in SDK_NAMES:
                for history in ("extend", "rerender"):
                    name = f"{tpl}/{sdk}/{history}"
                    cells[(tpl, sdk, history)] = run_cell(name, ups[tpl], dirs[tpl], tmp / "stores" / name.replace(
                        "/", "-"), history, sdk, args.episodes)
        print("merged/multi-call     " + "".join(f"{t + ' ' + h:>18s}" for t in dirs for h in ("extend", "rerender")))
        for sdk in SDK_NAMES:
            print(f"{sdk:21s} " + "".join(f"{cells[(t, sdk, h)]['frac']:18.2f}" for t in dirs
                                         for h in ("extend", "rerender")))

        auth = {"Authorization": f"Bearer {TOKEN}"}
        rec_urls, rec_pids = {}, {}
        for history in ("rerender", "extend"):
            rec_port = free_port()
            procs.append(spawn(["record", "--upstream", ups["qwen3"], "--store", str(tmp / "stores" / f"load-{history}"),
                                "--port", str(rec_port), "--tokenizer", str(dirs["qwen3"]), "--reply-parser", "qwen3",
                                "--chat-history", history], rec_port, env, tmp / f"record-{history}.log", auth))
            rec_urls[history], rec_pids[f"record-{history}"] = f"http://127.0.0.1:{rec_port}", procs[-1].pid
        ratios = throughput(ups["qwen3"], rec_urls, dirs["qwen3"], args.seconds, args.rounds,
                            {"serve": procs[0].pid, **rec_pids})
        unrecordable = unrecordable_recorded(rec_urls)
        print(f"unrecordable calls recorded as trainable (extend and rerender): {unrecordable}", flush=True)
    finally:
        for p in reversed(procs):
            stop(p)
    try:
        prefix = prefix_cache_part(args.prefix_cache, tmp / "prefix-cache", args.prefix_cache_replicas)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    goal_sdk = all(c["frac"] >= 0.95 for (t, s, h), c in cells.items() if h == "extend")
    st, ch, co = ratios["chat streamed"], ratios["chat"], ratios["completions"]
    print(f"goals: every SDK >= 0.95 merged with extend on every template: {'PASS' if goal_sdk else 'MISS'}; "
          f"streamed ratio no worse than plain completions' ({st:.3f} vs {co:.3f}): {'PASS' if st >= co else 'MISS'}, "
          f"than non-streamed chat's ({st:.3f} vs {ch:.3f}): {'PASS' if st >= ch else 'MISS'}; "
          f"streamed through an extending recorder {ratios[EXTEND_KIND]:.3f} vs plain completions' {co:.3f}: "
          f"{'PASS' if ratios[EXTEND_KIND] >= co else 'MISS'}; {prefix['goal']}; "
          f"{time.monotonic() - t_start:.0f} s in all")
    sdk_part = " ".join(f"{s}={cells[('qwen3', s, 'extend')]['frac']:.2f}" for s in SDK_NAMES)
    tpl_part = " ".join(f"{t}={cells[(t, 'openai-agents', 'extend')]['frac']:.2f}/"
                        f"{cells[(t, 'openai-agents', 'rerender')]['frac']:.2f}" for t in dirs)
    print(f"agent_traffic: merged/multi-call {sdk_part}; extend/rerender {tpl_part}; "
          f"unrecordable-in-extend={unrecordable}; prefix-cache hit sticky/least-requests={prefix['value']}; "
          f"recorder/direct streaming c=8={ratios['chat streamed']:.2f}; "
          f"recorder/direct streaming extend c=8={ratios[EXTEND_KIND]:.2f}")


if __name__ == "__main__":
    main()
