"""One prepared check of the ``vllm-weight-transfer`` deploy target on GPUs (not a test).

    PYTHONPATH=. python scripts/gpu_weight_transfer_check.py [--size tiny-dense] [--scheme bf16] [--out DIR]

Needs two CUDA GPUs (NCCL refuses two ranks of one group on one device): this process is the
trainer's NCCL rank 0 on GPU 0, the vLLM server runs on GPU 1. vLLM's CUDA build must import in this
interpreter (rank 0 uses its NCCL code); the server runs on ``$PRODRL_VLLM_PYTHON``, else this one.
Without a GPU (or with one) it says what it needs and exits 0.

1. two lab policies of one architecture built from a config (seeds 0 and 1; no downloads), exported;
2. vLLM on export A, dev mode (``VLLM_SERVER_DEV_MODE=1``), ``--weight-transfer-config '{"backend": "nccl"}'``;
3. control: the parity probe of export B against the server (serving A) must fail;
4. A rolled out as v-a through the target (group init + a first transfer), then B as v-b while a
   client keeps sending completions: the probe against B must pass (the weights really moved),
   ``/weight_info`` must say v-b, no client call may fail; update time = pause to resume;
5. the target's rollback (as after a failed probe): A sent back over NCCL, the probe against A
   passes, ``/weight_info`` says v-a.
Prints a JSON summary; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42, 9, 9], [1, 12, 13], [1, 20, 21, 22, 23, 24, 25],
           [1, 30, 31, 32], [1, 7, 7, 8, 9, 10, 11], [1, 50, 51], [1, 60, 61, 62, 63]]
FAIL: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAIL.append(what)


def traffic(url: str, stop: threading.Event, stats: dict) -> None:
    """Completions one after another until ``stop``: how many, how many failed, the slowest."""
    body = json.dumps({"model": "policy", "prompt": [1, 5, 6, 7], "max_tokens": 16, "temperature": 1.0}).encode()
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                ok = r.status == 200
        except OSError:
            ok = False
        stats["calls"] += 1
        stats["failed"] += 0 if ok else 1
        stats["slowest_s"] = max(stats["slowest_s"], time.monotonic() - t0)


def weight_version(url: str) -> str:
    with urllib.request.urlopen(url + "/weight_info", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny-dense", help="lab model size (built from its config)")
    ap.add_argument("--scheme", default="bf16", choices=["bf16", "nvfp4-w4a16", "nvfp4-w4a4"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        need = "no GPU here" if not torch.cuda.is_available() else "one GPU here"
        print(json.dumps({"ran": False, "reason": f"{need}: this check needs two CUDA GPUs (trainer rank 0 and "
                                                  "the vLLM server on distinct devices: NCCL refuses two ranks on one)"}))
        return 0
    try:
        import vllm.distributed.weight_transfer.nccl_common  # noqa: F401
    except ImportError as e:
        print(json.dumps({"ran": False, "reason": f"vLLM's CUDA build does not import here ({e})"}))
        return 2

    from prodrl_pipelines.config import environment
    from prodrl_pipelines.config.settings import Settings
    from prodrl_pipelines.deploy_targets import make_target
    from prodrl_pipelines.deploy_targets.base import wait_healthy
    from prodrl_pipelines.deploy_targets.probe import parity_probe
    from prodrl_pipelines.deploy_targets.processes import pick_port, tail
    from prodrl_pipelines.deploy_targets.rollout import roll_out
    from prodrl_pipelines.deploy_targets.server_records import stop_process_group
    from prodrl_pipelines.engines.vllm_client import vllm_serve_command, vllm_serve_env
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.quant.export import export_policy

    root = Path(args.out or tempfile.mkdtemp(prefix="weight_transfer_check-"))
    print(f"[1] two {args.size} lab policies, {args.scheme} exports, under {root}")
    exports = {}
    for name, seed in (("a", 0), ("b", 1)):
        ckpt = build_base_policy(root / name, size=args.size, seed=seed, sft_steps=5, progress=False)
        exports[name] = root / f"{name}-{args.scheme}"
        export_policy(ckpt, exports[name], args.scheme, calibration_prompts=PROMPTS * 4 if "w4a4" in args.scheme else None)
    port = pick_port()
    url = f"http://127.0.0.1:{port}"
    print(f"[2] vLLM on export A (GPU 1), dev mode, nccl weight transfer, {url}")
    env = {**vllm_serve_env("127.0.0.1"), "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "1"}
    cmd = vllm_serve_command(exports["a"], port, 20, served_model_name="policy",
                             python=environment.vllm_python() or sys.executable,
                             extra_args=["--max-model-len", "512", "--gpu-memory-utilization", "0.3",
                                         "--weight-transfer-config", '{"backend": "nccl"}'])
    log = root / "server.log"
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    summary: dict = {"ran": True, "size": args.size, "scheme": args.scheme}
    try:
        summary["server_startup_s"] = round(wait_healthy(url, 900, expect_model="policy", alive=lambda: proc.poll() is None,
                                                         log_tail=lambda: tail(log, 40)), 1)
        torch.cuda.set_device(0)  # rank 0 of the transfer group: the trainer's GPU
        settings = Settings(home=str(root / "home"), deploy={
            "target": "vllm-weight-transfer", "target_endpoint": url, "export_scheme": args.scheme,
            "probe_prompts": len(PROMPTS), "num_top_logprobs": 8, "max_tokens": 16})
        print("[3] control: B's probe against the server serving A")
        control = parity_probe(settings, exports["b"], PROMPTS, url, "policy")
        summary["control_probe_mean"] = control.mean_abs
        check(not control.passed, f"the probe tells A from B (mean {control.mean_abs:.4f})")
        target = make_target(settings)
        print("[4] A as v-a, then B as v-b under traffic")
        ro_a = roll_out(settings, target, exports["a"], "v-a", PROMPTS)
        summary["first_update_s"] = round(ro_a.switch.detail["update_seconds"], 3)
        stats, stop = {"calls": 0, "failed": 0, "slowest_s": 0.0}, threading.Event()
        client = threading.Thread(target=traffic, args=(url, stop, stats), daemon=True)
        client.start()
        time.sleep(1.0)
        try:
            ro_b = roll_out(settings, target, exports["b"], "v-b", PROMPTS)
        finally:
            time.sleep(1.0)
            stop.set()
            client.join(150)
        summary.update(update_s=round(ro_b.switch.detail["update_seconds"], 3), probe_b_mean=ro_b.probe.mean_abs,
                       probe_b_p99=ro_b.probe.p99_abs, traffic=stats)
        check(ro_b.probe.passed, f"probe against B passed after the transfer (mean {ro_b.probe.mean_abs:.4f})")
        check(weight_version(url) == "v-b", "/weight_info reports v-b")
        check(stats["calls"] > 0 and stats["failed"] == 0, f"no client call failed during the update ({stats})")
        print("[5] rollback to A over NCCL")
        summary["rollback"] = target.rollback(ro_b.switch)
        probe_a = parity_probe(settings, exports["a"], PROMPTS, url, "policy")
        summary["probe_a_after_rollback_mean"] = probe_a.mean_abs
        check(summary["rollback"].startswith("v-a sent again"), f"A was sent again ({summary['rollback']})")
        check(probe_a.passed and weight_version(url) == "v-a", "probe against A passes, /weight_info reports v-a")
    except Exception as e:  # noqa: BLE001 - reported in the summary with the server's log
        check(False, f"{type(e).__name__}: {e}")
        summary["server_log_tail"] = tail(log, 40)
    finally:
        stop_process_group(proc.pid)
    summary["failures"] = FAIL
    print(json.dumps(summary, default=float))
    return 1 if FAIL else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
