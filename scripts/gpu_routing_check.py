"""One prepared check of MoE routing capture through a real server and the recorder (not a test).

    PYTHONPATH=. python scripts/gpu_routing_check.py [--server vllm|prodrl-serve] [--out DIR]

1. builds the demo lab MoE (2 layers, 4 experts, top-2; no downloads) and exports it (bf16);
2. serves it with ``--enable-return-routed-experts`` (vLLM: with ``VLLM_USE_V2_MODEL_RUNNER=1``, GPU
   only; vLLM 0.32's CPU build refuses the flag) behind the recorder;
3. sends completions through the recorder, then reads the store: every call must carry routing that
   fits it (``check_fits``: [prompt + output - 1, layers, k], ids < experts);
4. the fp32 trainer on the recorded tokens: the share of positions whose recorded experts differ
   from its own routing, and |log pi_k - log mu| mean / p99 / max with and without replay.

``--server prodrl-serve`` runs the same path on a CPU machine (the local engine as the deployment).
Prints every figure; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAIL: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAIL.append(what)


def start_server(kind: str, export: Path, port: int, log: Path) -> subprocess.Popen:
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.engines.vllm_client import vllm_serve_command, vllm_serve_env

    if kind == "vllm":
        cmd = vllm_serve_command(export, port, 20, served_model_name="v0", python=environment.vllm_python(),
                                 extra_args=["--enable-return-routed-experts", "--max-model-len",
                                                                   "512", "--gpu-memory-utilization", "0.3"])
        env = {**os.environ, **vllm_serve_env("127.0.0.1"), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    else:
        cmd = [sys.executable, "-m", "prodrl_pipelines.cli", "serve", str(export), "--port", str(port),
               "--served-model-name", "v0", "--generation-config", "vllm", "--enable-return-routed-experts"]
        env = dict(os.environ)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(url)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=["vllm", "prodrl-serve"], default="vllm")
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=32)
    args = ap.parse_args()
    import httpx

    from prodrl_pipelines.deploy_targets.processes import pick_port
    from prodrl_pipelines.engines.server import BackgroundServer
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.quant.export import export_policy
    from prodrl_pipelines.recorder import RecorderConfig, build_recorder_app
    from prodrl_pipelines.rl.checkpoint import load_policy
    from prodrl_pipelines.rl.batch import pack_sequences
    from prodrl_pipelines.rl.logprobs import policy_logprobs
    from prodrl_pipelines.rl.routing_replay import RoutingStats, moe_shape
    from prodrl_pipelines.rl.sequences import minibatch_sequences
    from prodrl_pipelines.rl.trajectory import trajectories_from_table
    from prodrl_pipelines.trajectories.routing import check_fits, decode_routing

    root = Path(args.out or tempfile.mkdtemp(prefix="routing_check-"))
    print(f"[1] demo lab MoE and its bf16 export under {root}")
    ckpt = build_base_policy(root / "base", size="demo", progress=False)
    export_policy(ckpt, root / "bf16", "bf16")
    port = pick_port()
    print(f"[2] {args.server} with --enable-return-routed-experts on port {port}")
    proc = start_server(args.server, root / "bf16", port, root / "server.log")
    try:
        wait_up(f"http://127.0.0.1:{port}", proc)
        cfg = RecorderConfig(upstream=f"http://127.0.0.1:{port}", store_dir=str(root / "store"),
                             tokenizer_dir=str(ckpt), token="t")
        app = build_recorder_app(cfg)
        rng = np.random.default_rng(0)
        with BackgroundServer(app) as rec, httpx.Client(base_url=rec.url, timeout=120,
                                                        headers={"Authorization": "Bearer t"}) as c:
            print(f"[3] {args.calls} completions through the recorder")
            for i in range(args.calls):
                prompt = rng.integers(3, 100, int(rng.integers(6, 40))).tolist()
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "seed": i, "temperature": 1.0},
                           headers={"X-Trajectory-Id": f"t{i}"})
                if r.status_code != 200 or "routed_experts" in r.json()["choices"][0]:
                    check(False, f"call {i} answered without routing in the client's answer ({r.status_code})")
            stats = c.get("/stats").json()["counters"]
            app.state.recorder.ingestor.flush(60)
            calls = app.state.recorder.store.read_calls()
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"  recorder counters: routing_recorded={stats.get('routing_recorded', 0)} "
          f"routing_malformed={stats.get('routing_malformed', 0)}")
    check(stats.get("routing_recorded", 0) == args.calls, "every call recorded routing")
    model, _ = load_policy(ckpt, dtype=torch.float32)
    layers, k, experts = moe_shape(model)
    rows = calls.to_pylist()
    fits = [check_fits(decode_routing(x["routed_experts"]), len(x["prompt_token_ids"]), len(x["output_token_ids"]),
                       x["routed_experts_start"] or 0, layers, k, experts) if x["routed_experts"] else "none"
            for x in rows]
    check(all(f is None for f in fits), f"routing fits every call ({[f for f in fits if f][:3]})")
    print("[4] the fp32 trainer on the recorded tokens")
    table = calls.append_column("reward", pa.array([0.0] * calls.num_rows))
    trajs = trajectories_from_table(table)
    b = pack_sequences(minibatch_sequences(trajs, np.zeros(len(trajs))), 0, with_routing=True)
    st = RoutingStats()
    with torch.no_grad():
        on = policy_logprobs(model, b, replay=True, routing_stats=st)[:, 0]
        off = policy_logprobs(model, b, replay=False)[:, 0]
    d_on, d_off = (on - b.logp_mu).abs().double().numpy(), (off - b.logp_mu).abs().double().numpy()
    res = {"tokens": len(d_on), "disagreement": st.disagreement, "per_layer": st.per_layer(),
           "mean_off": d_off.mean(), "mean_on": d_on.mean(), "p99_off": float(np.quantile(d_off, 0.99)),
           "p99_on": float(np.quantile(d_on, 0.99)), "max_off": d_off.max(), "max_on": d_on.max()}
    print("  " + json.dumps(res, default=float))
    check(res["mean_on"] <= res["mean_off"] + 1e-6, "replay does not increase the mean mismatch")
    print("\nsummary:", json.dumps({"server": args.server, "failures": FAIL, **res}, default=float))
    return 1 if FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
