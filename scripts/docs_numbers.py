#!/usr/bin/env python
"""The measured tables of README.md and docs/, made from the JSON their commands wrote.

    python scripts/docs_numbers.py                     # rewrite every marked block from docs/results/
    python scripts/docs_numbers.py --check             # exit 1 where a block differs from its results
    python scripts/docs_numbers.py --store NAME FILE   # keep a command's JSON as docs/results/NAME.json, rewrite

The stored results and the commands that write them:

    reward_hacking  prodrl lab reward-hacking                                   runs/reward-hacking/reward_hacking.json
    slow_drift      prodrl lab reward-hacking --slow-drift --name slow-drift    runs/slow-drift/reward_hacking.json
    demo_local      PRODRL_LAB_TRAFFIC=http-seeded prodrl demo --rounds 4 --name demo-local   runs/demo-local/summary.json
    demo_vllm       prodrl demo --engine vllm --rounds 4 --name demo-vllm       runs/demo-vllm/summary.json

A block sits between ``<!-- docs-numbers:NAME -->`` and ``<!-- /docs-numbers:NAME -->`` in a markdown
file; NAME is a key of ``BLOCKS``, which says which stored result it is made from and how. Each block
states the command, the commit and the machine the result came from, and the findings the prose
relies on are written from the same numbers, so a rerun that changes them changes the text too.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = "docs/results"
MARK = re.compile(r"<!-- docs-numbers:(?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)<!-- /docs-numbers:(?P=name) -->",
                  re.S)


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _provenance(r: dict, stored: str) -> str:
    return (f"_Measured by `{r.get('command', '?')}` at commit `{r.get('commit', '?')}` on {r.get('machine', '?')}, "
            f"{r.get('seconds', '?')} s; stored as `{stored}`. Regenerate: `python scripts/docs_numbers.py`._")


def _failing(monitors: dict) -> list[str]:
    return [f"{k} {v['value']:+.3f}" + (" (blocks)" if v.get("blocking") else " (warns)")
            for k, v in monitors.items() if not v["passed"]]


def _gate(r: dict) -> str:
    if not r["gate_passed"]:
        return "blocked"
    return "passed, deployed" if r["deployed"] else "passed, not deployed"


def _rounds_table(rounds: list[dict]) -> list[str]:
    out = ["| round | grader | reward trained on | exact rule, same data | hedged answers | held-out (cand / live) "
           "| holey grader on held-out (cand / live) | monitors failing (vs live) | cumulative failing (vs reference) "
           "| gate |", "|---|" * 1 + "---|" * 9]
    for r in rounds:
        out.append(
            f"| {int(r['round'].split('-')[1])} | {r['grader'].split('_')[1]} | {_f(r['trained_reward'])} "
            f"| {_f(r['exact_reward'])} | {r['hedge_rate']:.0%} | {_f(r['heldout_reward'])} / "
            f"{_f(r['live_heldout_reward'])} | {_f(r['heldout_holey'])} / {_f(r['live_heldout_holey'])} "
            f"| {', '.join(_failing(r['monitors'])) or '-'} | {_cumulative(r)} | {_gate(r)} |")
    return out


def _cumulative(r: dict) -> str:
    bad = _failing(r.get("cumulative_monitors") or {})
    return "-" if not bad else (f"vs {r['reference']}: " if r.get("reference") else "") + ", ".join(bad)


def _blocked_by(r: dict) -> str:
    names = [k for k, v in r["monitors"].items() if not v["passed"] and v.get("blocking")]
    names += [f"cumulative {k}" for k, v in (r.get("cumulative_monitors") or {}).items()
              if not v["passed"] and v.get("blocking")]
    reward = any(x.startswith("held-out reward regression") for x in r.get("gate_reasons") or [])
    parts = (["the paired held-out test"] if reward else []) + names
    return ", ".join(parts) or "no blocking check (a warning only)"


def _span(rounds: list[dict]) -> str:
    ks = [int(r["round"].split("-")[1]) for r in rounds]
    return f"{ks[0]}-{ks[-1]}" if len(ks) > 1 else str(ks[0])


def render_reward_hacking(r: dict, stored: str) -> str:
    rounds = r["rounds"]
    hack = [x for x in rounds if x["grader"].endswith("anywhere")]
    fixed = [x for x in rounds if x["grader"].endswith("exact")]
    base = r.get("base_heldout_reward")
    lines = [_provenance(r, stored), "", *_rounds_table(rounds), ""]
    deployed_hacks = [x for x in hack if x["deployed"]]
    lines.append(f"- **Rounds {_span(hack)}, the hole.** The holey grader pays "
                 f"{min(x['trained_reward'] for x in hack):.3f}-{max(x['trained_reward'] for x in hack):.3f} on the "
                 f"traffic while the exact rule gives the same data {min(x['exact_reward'] for x in hack):.3f}-"
                 f"{max(x['exact_reward'] for x in hack):.3f}. The candidates' true held-out reward "
                 f"({', '.join(_f(x['heldout_reward']) for x in hack)}) stays below the base's {_f(base)}. "
                 + (f"{len(deployed_hacks)} of {len(hack)} hack rounds deployed "
                    f"({', '.join(x['round'] for x in deployed_hacks)})." if deployed_hacks else
                    "Every hack round is blocked: " + "; ".join(f"round {int(x['round'][-6:])} by {_blocked_by(x)}"
                                                              for x in hack) + "."))
    rs = r["rescore"]
    lines.append(f"- **The fix.** `rescore` re-scores all {rs['trajectories']:,} stored trajectories with "
                 f"`arithmetic_exact` and keeps the old rows: {rs['changed']:,} rewards change, mean |change| "
                 f"{rs['mean_abs_change']:.3f}, mean reward {rs['old_mean']:.3f} -> {rs['new_mean']:.3f}. The rounds "
                 f"already trained keep the rewards they used.")
    if fixed:
        last = fixed[-1]
        blocked = [x for x in fixed if not x["gate_passed"]]
        lines.append(
            f"- **Rounds {_span(fixed)}, recovery.** On honest rewards the held-out reward goes "
            f"{' -> '.join(_f(x['heldout_reward']) for x in fixed)}"
            + (f" (round {', '.join(str(int(x['round'][-6:])) for x in blocked)} blocked by "
               f"{'; '.join(_blocked_by(x) for x in blocked)})" if blocked else "")
            + f", ending {'above' if last['heldout_reward'] > base else 'at or below'} the base's {_f(base)}; "
            f"hedging in the traffic {hack[-1]['hedge_rate']:.0%} -> {last['hedge_rate']:.0%}.")
    return "\n".join(lines) + "\n"


def render_slow_drift(r: dict, stored: str) -> str:
    rounds = [x for x in r["rounds"] if x["grader"].endswith("anywhere")]
    lines = [_provenance(r, stored), "",
             "| round | hedged answers | held-out (cand / live) | format errors vs live | format errors vs "
             "reference | reference | monitors failing (vs live) | cumulative failing (vs reference) | gate |",
             "|---|" + "---|" * 8]
    for x in rounds:
        fe, cfe = x["monitors"].get("format_errors", {}), (x.get("cumulative_monitors") or {}).get("format_errors", {})
        lines.append(f"| {int(x['round'][-6:])} | {x['hedge_rate']:.0%} | {_f(x['heldout_reward'])} / "
                     f"{_f(x['live_heldout_reward'])} | {_f(fe.get('value'), '+.3f')} | {_f(cfe.get('value'), '+.3f')} "
                     f"| {x.get('reference') or '-'} | {', '.join(_failing(x['monitors'])) or '-'} "
                     f"| {', '.join(_failing(x.get('cumulative_monitors') or {})) or '-'} | {_gate(x)} |")
    deployed = [x for x in rounds if x["deployed"]]
    caught = [x for x in rounds if x["gate_reasons"] and all(g.startswith("cumulative monitor")
                                                             for g in x["gate_reasons"])]
    lines.append("")
    fe = [x["monitors"].get("format_errors", {}).get("value") for x in deployed]
    lines.append(f"- {len(deployed)} of {len(rounds)} rounds on the holey grader deployed"
                 + (f" ({', '.join(str(int(x['round'][-6:])) for x in deployed)}), each within every per-round "
                    f"check against the live policy before it (format errors vs live at most "
                    f"{max(v for v in fe if v is not None):+.3f})" if deployed else "")
                 + f". Hedging in the traffic went {rounds[0]['hedge_rate']:.0%} -> {rounds[-1]['hedge_rate']:.0%}; "
                 f"the held-out reward peaked at {max(x['heldout_reward'] for x in rounds):.3f} and the last "
                 f"candidate's is {_f(rounds[-1]['heldout_reward'])}, against the base's {_f(r.get('base_heldout_reward'))}.")
    if caught:
        c = caught[0]
        lines.append(f"- Round {int(c['round'][-6:])} passes the paired test and every per-round monitor against "
                     f"live, and is blocked by the cumulative monitor alone, against {c['reference']}: "
                     f"{', '.join(_failing({k: v for k, v in c['cumulative_monitors'].items() if v.get('blocking')}))}.")
    else:
        lines.append("- No round was blocked by a cumulative monitor alone in this run.")
    return "\n".join(lines) + "\n"


def _ci(r: dict) -> str:
    return "-" if r["heldout_reward"] is None else f"{r['heldout_reward']:.3f} ± {r['heldout_reward_ci']:.3f}"


def _probe(r: dict) -> str:
    # 4 decimals: the probe's floating noise (~1e-7 here, from how the server batched the probe's
    # prompts) differs between two otherwise identical runs
    return "-" if r.get("probe_mean_abs") is None else f"{r['probe_mean_abs']:.4f} / {r['probe_p99_abs']:.4f}"


def render_demo_engines(local: dict, vllm: dict | None, stored: list[str]) -> str:
    """``prodrl demo`` on the local engine and, once its run is stored, on vLLM, side by side."""
    head = "| round | local engine: held-out | local: \\|log pi_k - log mu\\| | local probe mean / p99 |"
    lines = [f"_Local engine: {_provenance(local, stored[0])[1:-1]}_", ""]
    if vllm is None:  # the local columns alone until a vLLM run is stored
        vllm = {"rounds": [], "seconds": None}
        lines += [f"_vLLM: no stored run ({stored[1]})._", "", head, "|---|" + "---|" * 3]
    else:
        lines += [f"_vLLM: {_provenance(vllm, stored[1])[1:-1]}_", "",
                  head + " vLLM: held-out | vLLM: \\|log pi_k - log mu\\| | vLLM probe mean / p99 |",
                  "|---|" + "---|" * 6]
    by_round = {r["round"]: r for r in vllm["rounds"]}
    for r in local["rounds"]:
        row = f"| {r['round']} | {_ci(r)} | {_f(r['mismatch_abs_logp'], '.4f')} | {_probe(r)} |"
        if by_round:
            v = by_round.get(r["round"], {"heldout_reward": None})
            row += f" {_ci(v)} | {_f(v.get('mismatch_abs_logp'), '.4f')} | {_probe(v)} |"
        lines.append(row)
    mm = lambda d: [r["mismatch_abs_logp"] for r in d["rounds"] if r.get("mismatch_abs_logp") is not None]  # noqa: E731
    dep = [r["deploy_seconds"] for r in vllm["rounds"] if r.get("deploy_seconds")]
    lines += ["", f"- The mismatch column is the seed's engine mismatch: NVFP4 weights on the local engine "
              f"({min(mm(local)):.4f}-{max(mm(local)):.4f})"
              + (f", vLLM's bf16 kernels against the fp32 trainer ({min(mm(vllm)):.4f}-{max(mm(vllm)):.4f})."
                 if mm(vllm) else ".")]
    if vllm["rounds"]:
        lines.append((f"- Each vLLM deploy took {min(dep):.0f}-{max(dep):.0f} s from \"deploy\" to \"probe passed\"; "
                      if dep else "- ") + f"the whole vLLM run {vllm['seconds']:.0f} s against {local['seconds']:.0f} s "
                     f"on the local engine.")
    return "\n".join(lines) + "\n"


BLOCKS: dict[str, tuple[tuple[str, ...], Callable[..., str]]] = {
    "reward_hacking": (("reward_hacking.json",), render_reward_hacking),
    "slow_drift": (("slow_drift.json",), render_slow_drift),
    "demo_engines": (("demo_local.json", "demo_vllm.json?"), render_demo_engines),
}  # a result ending in "?" is optional: its renderer gets None until it is stored


def render(name: str, root: Path) -> str:
    if name not in BLOCKS:
        raise KeyError(f"unknown docs-numbers block {name!r}; known: {', '.join(BLOCKS)}")
    files, fn = BLOCKS[name]
    stored = [f"{RESULTS}/{f.rstrip('?')}" for f in files]
    data = []
    for f, path in zip(files, stored):
        if (root / path).exists():
            data.append(json.loads((root / path).read_text()))
        elif f.endswith("?"):
            data.append(None)
        else:
            raise FileNotFoundError(f"block {name!r} needs {path}: run its command and store its JSON "
                                    f"(python scripts/docs_numbers.py --store {Path(path).stem} PATH)")
    return fn(*data, stored if len(stored) > 1 else stored[0])


def markdown_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def update(root: Path, check: bool) -> list[str]:
    """Rewrite (or, with ``check``, compare) every block; returns the problems found."""
    problems, seen = [], set()
    for md in markdown_files(root):
        if not md.exists():
            continue
        text = md.read_text()

        def sub(m: re.Match) -> str:
            name = m.group("name")
            seen.add(name)
            try:
                body = render(name, root)
            except (KeyError, FileNotFoundError) as e:
                problems.append(f"{md.relative_to(root)}: {e}")
                return m.group(0)
            if body != m.group("body"):
                diff = "".join(difflib.unified_diff(m.group("body").splitlines(True), body.splitlines(True),
                                                    "docs", "results", n=0))
                problems.append(f"{md.relative_to(root)}: block {name!r} differs from "
                                f"{', '.join(RESULTS + '/' + f.rstrip('?') for f in BLOCKS[name][0])}:\n{diff}")
            return f"<!-- docs-numbers:{name} -->\n{body}<!-- /docs-numbers:{name} -->"

        new = MARK.sub(sub, text)
        if not check and new != text:
            md.write_text(new)
    for name in sorted(set(BLOCKS) - seen):
        problems.append(f"block {name!r} ({', '.join(BLOCKS[name][0])}) appears in no markdown file")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on any difference")
    ap.add_argument("--store", nargs=2, metavar=("NAME", "FILE"), help="keep FILE as the stored result of block NAME")
    ap.add_argument("--root", default=str(REPO), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    root = Path(a.root)
    if a.store:
        name, src = a.store
        known = [Path(f.rstrip("?")).stem for files, _ in BLOCKS.values() for f in files]
        if name not in known:
            ap.error(f"unknown result {name!r}; known: {', '.join(known)}")
        (root / RESULTS).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / RESULTS / f"{name}.json")
    problems = update(root, a.check)
    if a.check:
        for p in problems:
            print(p, file=sys.stderr)
        print(f"docs-numbers: {'ok' if not problems else f'{len(problems)} problem(s)'}", file=sys.stderr)
        return 1 if problems else 0
    real = [p for p in problems if "differs" not in p]  # differences were just rewritten
    for p in real:
        print(p, file=sys.stderr)
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
