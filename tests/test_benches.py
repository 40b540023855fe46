"""Every benchmark still runs: ``bench/NAME.py --smoke`` (bench/_smoke.py) exits 0 and its last line
is ``NAME: key=value; ...`` with the keys of a last-line template its docstring gives (``NAME: ...``
in double backquotes, or an indented line). A smoke run's numbers mean nothing: no timing or ratio
is checked. A new ``bench/*.py`` is picked up by the glob (``bench/_*.py`` are helpers).

A bench that needs vLLM prints ``skipped: ...`` without it (``_vllm.vllm_python_or_exit``, also
under ``PRODRL_SKIP_VLLM=1``): skipped as tests/vllm_support.py skips (failed under ``CI=true``).
Each bench runs under a guard that makes it the subreaper of everything it starts: what is still
running once it exits (a Ray cluster, a server) fails the test and is killed, by pid; so is all of
it on a timeout.
"""

from __future__ import annotations

import ast
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHES = sorted(p for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))
TIMEOUT_S = 600

# ~460 s in all on the 2-core machine when quiet (~420 s CPU), 18 min beside a full test run: most of
# it the Ray, vLLM, agent-SDK and serving benches, whose processes and servers start at every size
pytestmark = pytest.mark.long(seconds=460)

# Runs ``python BENCH ARGS`` as its child and, being its subreaper (PR_SET_CHILD_SUBREAPER), adopts
# whatever the bench leaves behind. After the bench exits (or on SIGTERM: the test's timeout) every
# process still below the guard gets a grace period, then SIGKILL by pid; the ones left are named on
# stderr and the guard exits 70. Its last line: the CPU seconds of the bench and the processes reaped.
GUARD = r"""
import ctypes, os, resource, signal, subprocess, sys, time

def below(root):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                kids.setdefault(int(stat[1]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out

def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"

def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass

ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
bench = subprocess.Popen([sys.executable, *sys.argv[1:]])
signal.signal(signal.SIGTERM, lambda *_: bench.kill())
rc = bench.wait()
deadline = time.monotonic() + 20  # what the bench stopped may take a moment to exit
while below(os.getpid()) and time.monotonic() < deadline:
    reap()
    time.sleep(0.2)
left = {pid: cmdline(pid) for pid in below(os.getpid())}
for pid in left:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
time.sleep(0.5)
reap()
if left:
    print(f"guard: {len(left)} process(es) still running after the bench, killed: {left}", file=sys.stderr)
cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"guard: cpu_s={cpu.ru_utime + cpu.ru_stime:.1f}", file=sys.stderr)
sys.exit(70 if left and rc == 0 else rc)
"""


def _norm(s: str) -> str:
    """Numbers and placeholders (``N``, ``X``, ``MODEL``) as ``#``: sizes differ at smoke size."""
    return re.sub(r"\d+(\.\d+)?", "#", re.sub(r"\b[A-Z][A-Z0-9_]*\b", "#", s))


def _templates(path: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    stem = re.escape(path.stem)
    found = [" ".join(t.split()) for t in re.findall(rf"``({stem}: [^`]+)``", doc)]
    found += [t.strip() for t in re.findall(rf"^\s*({stem}: \S.*)$", doc, re.M)]
    return [t for t in found if "=" in t]


def _keys(template: str) -> list[str]:
    """The keys a template names (the word before each ``=``); ``[...]`` parts are optional."""
    body = re.sub(r"\[[^\]]*\]", "", template.split(": ", 1)[1])
    keys = [_norm(k) for k in re.findall(r"([^\s=;,\[\]]+)=", body)]
    return [k for k in keys if re.search(r"[a-z]", k)]  # a bare placeholder names nothing


def _run(path: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-c", GUARD, str(path), "--smoke"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the guard kills the bench and everything it started
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{path.name} --smoke ran over {TIMEOUT_S} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("path", BENCHES, ids=[p.stem for p in BENCHES])
def test_the_bench_runs_at_smoke_size(path: Path):
    templates = _templates(path)
    assert templates, f"{path.name}'s docstring gives no last-line template ``{path.stem}: key=value; ...``"
    assert "--smoke" in path.read_text(), f"{path.name} has no smoke size (bench/_smoke.py)"
    t0 = time.monotonic()
    res = _run(path)
    cpu = re.findall(r"guard: cpu_s=(\S+)", res.stderr)
    print(f"{path.stem}: {time.monotonic() - t0:.0f} s, {cpu[-1] if cpu else '?'} s CPU")  # shown by -rP
    lines = res.stdout.strip().splitlines()
    tail = f"\n--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-3000:]}"
    assert res.returncode == 0, f"{path.name} --smoke exited {res.returncode} after {time.monotonic() - t0:.0f} s{tail}"
    last = lines[-1] if lines else ""
    if last.startswith("skipped: simulated hosts"):  # bench/hosts.py where namespaces are refused (not root)
        pytest.skip(last)
    if last.startswith("skipped:"):
        from vllm_support import vllm_python

        vllm_python()  # skips (PRODRL_SKIP_VLLM=1, no vLLM) or fails (CI) as the vLLM tests do
        pytest.fail(f"{path.name} skipped although vLLM is there: {last}")
    m = re.fullmatch(rf"{re.escape(path.stem)}: (.+)", last)
    assert m, f"{path.name}'s last line is not '{path.stem}: key=value; ...': {last!r}{tail}"
    parts = m.group(1).split("; ")
    assert all("=" in p for p in parts), f"{path.name}'s last line has a part without key=value: {last!r}"
    line = _norm(last)
    missing = {t: [k for k in _keys(t) if f"{k}=" not in line] for t in templates}
    assert any(not ks for ks in missing.values()), f"{path.name}'s last line {last!r} lacks keys: {missing}"


def test_the_template_keys_are_read_as_meant():
    t = "store_scale: tick(256)/tick(1)=X; s3 requests per tick at 256 rounds=N; p99_ratio=X [glm45=X/Y]"
    assert _keys(t) == ["tick(#)/tick(#)", "rounds", "p#_ratio"]
    line = _norm("store_scale: tick(3)/tick(1)=0.59; s3 requests per tick at 3 rounds=10; p99_ratio=1.2")
    assert all(f"{k}=" in line for k in _keys(t))
    assert _keys("train_scaling: params+Adam/rank 2/1 MODEL=X") == []
