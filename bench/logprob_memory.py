"""Peak memory of trainer log-probs at a real vocabulary: chunked vs full logits, same run.

Vocabulary 151,936 (Qwen3), 4,096 tokens, a synthetic lm_head. Each path runs forward + backward
in a fresh subprocess; we report peak RSS above the inputs' baseline and the ratio (target <= 0.25).
"""

import json
import os
import subprocess
import sys

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


def run(path: str) -> dict:
    code = CHILD.format(V=V, T=T, H=H, K=K)
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    full, chunked = run("full"), run("chunked")
    ratio = chunked["extra_bytes"] / full["extra_bytes"]
    rel = abs(full["checksum"] - chunked["checksum"]) / full["checksum"]
    print(f"log-prob memory, vocab {V}, {T} tokens, hidden {H}, head K={K}")
    print(f"  full logits : {full['extra_bytes'] / 2**30:6.2f} GiB peak extra, {full['seconds']:.2f} s")
    print(f"  chunked(512): {chunked['extra_bytes'] / 2**30:6.2f} GiB peak extra, {chunked['seconds']:.2f} s")
    print(f"  memory ratio chunked/full = {ratio:.3f} (target <= 0.25); grad checksum rel diff {rel:.1e}")


if __name__ == "__main__":
    main()
