"""Peak memory and time of trainer log-probs at a real vocabulary: chunked vs full logits, same run.

Vocabulary 151,936 (Qwen3), 4,096 tokens, a synthetic lm_head. Each path runs forward + backward
in a fresh subprocess, the two paths interleaved (full, chunked, full, chunked, ...: ``--repeats``);
we report peak RSS above the inputs' baseline and the ratio (target <= 0.25), and the median time
ratio chunked/full (target <= 1.3: the chunked path does four [chunk x V x H] matmuls per chunk
where full logits do three, so ~1.33 is its floor when the matmuls dominate).

Last line: ``logprob_memory: memory chunked/full=X; time chunked/full=X``.

Usage: ``python bench/logprob_memory.py [--repeats 2] [--vocab 151936] [--tokens 4096] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): vocabulary 4,096, 256 tokens, one run of each path.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import parse_args  # noqa: E402

V, T, H, K = 151_936, 4_096, 512, 20

CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(2)
from prodrl_pipelines.rl.logprobs import gather_logprobs, full_gather_logprobs
V, T, H, K, path = {V}, {T}, {H}, {K}, sys.argv[1]
g = torch.Generator().manual_seed(0)
h = (torch.randn(T, H, generator=g) * 0.05).requires_grad_()
w = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
ids = torch.randint(0, V, (T, 1 + K), generator=g)
tau = torch.ones(T)
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
base = rss()
t0 = time.perf_counter()
out = gather_logprobs(h, w, ids, tau, chunk=512) if path == 'chunked' else full_gather_logprobs(h, w, ids, tau)
out.sum().backward()
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"path": path, "extra_bytes": peak - base, "seconds": dt, "checksum": float(w.grad.abs().sum())}}))
"""


def run(path: str, vocab: int = V, tokens: int = T) -> dict:
    code = CHILD.format(V=vocab, T=tokens, H=H, K=K)
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import argparse
    import statistics

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2, help="runs of each path, interleaved")
    ap.add_argument("--vocab", type=int, default=V)
    ap.add_argument("--tokens", type=int, default=T)
    args = parse_args(ap, repeats=1, vocab=4096, tokens=256)
    runs = {"full": [], "chunked": []}
    for _ in range(args.repeats):
        for path in ("full", "chunked"):
            runs[path].append(run(path, args.vocab, args.tokens))
    full, chunked = runs["full"][0], runs["chunked"][0]
    t_full = statistics.median(r["seconds"] for r in runs["full"])
    t_chunk = statistics.median(r["seconds"] for r in runs["chunked"])
    ratio = max(r["extra_bytes"] for r in runs["chunked"]) / min(r["extra_bytes"] for r in runs["full"])
    rel = abs(full["checksum"] - chunked["checksum"]) / full["checksum"]
    print(f"log-prob memory and time, vocab {args.vocab}, {args.tokens} tokens, hidden {H}, head K={K}, {args.repeats} runs each, interleaved")
    each = {p: ", ".join("%.2f" % r["seconds"] for r in rs) for p, rs in runs.items()}
    print(f"  full logits : {full['extra_bytes'] / 2**30:6.2f} GiB peak extra, median {t_full:.2f} s ({each['full']})")
    print(f"  chunked(512): {chunked['extra_bytes'] / 2**30:6.2f} GiB peak extra, median {t_chunk:.2f} s ({each['chunked']})")
    print(f"  memory ratio chunked/full = {ratio:.3f} (target <= 0.25); grad checksum rel diff {rel:.1e}")
    print(f"  time ratio chunked/full = {t_chunk / t_full:.2f} (target <= 1.3)")
    print(f"logprob_memory: memory chunked/full={ratio:.3f}; time chunked/full={t_chunk / t_full:.2f}")


if __name__ == "__main__":
    main()
