"""What recording costs vLLM: generated tokens/s with the recording fields (``logprobs: 20``,
``return_token_ids``, ``return_tokens_as_token_ids``) against the same requests without them, at
concurrency 1 and 8, side by side in one run (rounds alternate, so drift hits both alike). Every
request generates exactly 64 tokens (``ignore_eos``) from a token-id prompt, seeded.

    python bench/vllm_logprobs_cost.py [--rounds 3] [--per-round 16] [--tokens 64] [--smoke]

Anchor: vLLM's own benchmark reports 0.95 at concurrency 1 and 0.73 at 64 for logprobs. Last line:
``vllm_logprobs_cost: recording/plain c=1=X; recording/plain c=8=X`` (tokens/s with the fields over without).

Smoke size (``--smoke``, bench/_smoke.py): the tiny dense lab policy on an eager vLLM, one round of one
request per client, 8 tokens each. Needs vLLM's venv (``make vllm``), like the full size.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import parse_args  # noqa: E402
from _vllm import SERVER_ARGS, dense_exports, vllm_python_or_exit  # noqa: E402

from prodrl_pipelines.deploy_targets.base import wait_healthy  # noqa: E402
from prodrl_pipelines.deploy_targets.server_records import stop_process_group  # noqa: E402
from prodrl_pipelines.engines.vllm_client import vllm_serve_command, vllm_serve_env  # noqa: E402
from prodrl_pipelines.deploy_targets.processes import pick_port  # noqa: E402

TOKENS, PER_ROUND, ROUNDS = 64, 16, 3


def run(url: str, concurrency: int, record: bool, seed0: int, per_round: int = PER_ROUND, tokens: int = TOKENS) -> float:
    def one(i: int) -> int:
        body = {"model": "p", "prompt": [1, 5 + i % 50, 6, 7, 8], "max_tokens": tokens, "ignore_eos": True,
                "temperature": 1.0, "seed": seed0 + i}
        if record:
            body.update(logprobs=20, return_token_ids=True, return_tokens_as_token_ids=True)
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    n = per_round * concurrency
    with httpx.Client(base_url=url, timeout=300) as client, ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        toks = sum(pool.map(one, range(n)))
        return toks / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--per-round", type=int, default=PER_ROUND, help="requests per client and round")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="generated per request")
    ap.add_argument("--policy-size", default="demo-dense")
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--eager", action="store_true", help="--enforce-eager: no compilation at start-up")
    args = parse_args(ap, rounds=1, per_round=1, tokens=8, policy_size="tiny-dense", sft_steps=2, eager=True)
    py = vllm_python_or_exit()
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        export = dense_exports(Path(tmp), 1, args.policy_size, args.sft_steps)[0]
        port = pick_port()
        server_args = [a for a in SERVER_ARGS if a != "--enforce-eager" or args.eager]
        with open(Path(tmp) / "vllm.log", "wb") as log:
            proc = subprocess.Popen(vllm_serve_command(export, port, 20, served_model_name="p", python=py,
                                                       extra_args=server_args),
                                    env=vllm_serve_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, 300, expect_model="p", alive=lambda: proc.poll() is None)
            run(url, 8, True, 0, args.per_round, args.tokens)  # warm-up
            for c in (1, 8):
                plain, rec = [], []
                for r in range(args.rounds):
                    plain.append(run(url, c, False, 1000 * r, args.per_round, args.tokens))
                    rec.append(run(url, c, True, 1000 * r, args.per_round, args.tokens))
                p, q = statistics.median(plain), statistics.median(rec)
                ratios[c] = q / p
                print(f"concurrency {c}: {p:7.0f} tok/s plain, {q:7.0f} tok/s recording -> ratio {q / p:.2f}")
        finally:
            stop_process_group(proc.pid)
    print(f"vllm_logprobs_cost: recording/plain c=1={ratios[1]:.2f}; recording/plain c=8={ratios[8]:.2f}")


if __name__ == "__main__":
    main()
