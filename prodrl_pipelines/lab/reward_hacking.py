"""The reward-hacking walkthrough (``prodrl lab reward-hacking``): rounds on a grader with a hole,
the monitors and the gate catching it, the grader fixed, ``rescore``, and rounds that recover.

The base policy's demonstrator hedges now and then (``lab_hedge_noise``: ``"12 13"``). Traffic is
scored by ``lab.graders:arithmetic_anywhere``, which accepts the right number anywhere, so hedging
pays; the held-out suite keeps the true rule (a bare integer). Then the grader becomes
``arithmetic_exact``, ``rescore`` re-scores every stored trajectory with it (the old rows stay), and
the loop continues on honest rewards.

Reproducible: lab traffic is played in process by default (one seeded batch per turn), so two runs
give the same table whatever directory they run in. Over HTTP (``--traffic http``) the server
batches concurrent calls and what is sampled depends on their arrival order; ``http-seeded``
sends each call with its own seed (reproducible, slower).

``--slow-drift``: the demo's learning rate, where the hack grows by a few points a round, under
every per-round threshold, and each round deploys; the cumulative monitors (against round 0, the
reference while nobody reviews) catch it once the drift adds up.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from prodrl_pipelines.lab.provenance import provenance

HOLEY = "prodrl_pipelines.lab.graders:arithmetic_anywhere"
EXACT = "prodrl_pipelines.lab.graders:arithmetic_exact"

# A learning rate 5x the demo's: at the demo's 1e-4 hedging creeps up ~2-3 points a round, below
# any per-round threshold; at 3e-4 a hack round sits at the thresholds (on one CPU it is blocked, on
# another, with other float rounding, it deploys); at 5e-4 the hack rounds fail the held-out gate and
# at least one monitor, except that the first round's drift can still stay under them (AVX2 kernels,
# seed 0: it deploys; the later ones are blocked); from 7e-4 the rounds after the fix overshoot too.
WALKTHROUGH_SETTINGS = {
    "lab_hedge_noise": 0.3, "rewards_sources": ["grader"], "rewards_grader": HOLEY, "learning_rate": 5e-4,
    "monitors_format_errors_blocking": True, "monitors_length_drift_blocking": True,
}
# The slow drift: at the demo's learning rate hedging grows a few points a round, each round passes
# every per-round threshold against live and deploys; against round 0 the drift adds up.
SLOW_DRIFT_SETTINGS = {"learning_rate": 1e-4}


def round_row(svc, rkey: str) -> dict:
    """One round as the walkthrough reports it: the reward it trained on (the grader's), what the
    exact rule says of the same trajectories, how often they hedge, the held-out reward, the monitors
    and the gate."""
    from prodrl_pipelines.lab.graders import arithmetic_anywhere, arithmetic_exact
    from prodrl_pipelines.rewards.view import views_from_calls
    from prodrl_pipelines.storage import documents, keys

    h = svc.ledger.round_summary(rkey)
    views = views_from_calls(documents.get_table(svc.blobs, keys.dataset(rkey)))
    ev = documents.get_json(svc.blobs, keys.heldout(rkey))
    outputs = [o for v in views for o in v.outputs]
    return {
        "round": rkey, "grader": svc.settings.rewards.grader.rsplit(":", 1)[-1],
        "trained_reward": h.get("data_reward_mean"),
        "holey_reward": sum(arithmetic_anywhere(v) for v in views) / len(views),
        "exact_reward": sum(arithmetic_exact(v) for v in views) / len(views),
        "hedge_rate": sum(len(o.split()) > 1 for o in outputs) / len(outputs),
        "heldout_reward": h.get("heldout_reward"), "live_heldout_reward": h.get("live_heldout_reward"),
        # the holey grader on the same held-out episodes: the reward the hack raises
        "heldout_holey": _heldout_holey(ev["candidate"]) if ev.get("candidate") else None,
        "live_heldout_holey": _heldout_holey(ev["live"]),
        "gate_passed": h.get("gate_passed"), "deployed": bool(h.get("deployed")),
        "gate_reasons": h.get("gate_reasons") or [],
        "monitors": _monitors(h.get("monitors")), "reference": h.get("monitor_reference"),
        "cumulative_monitors": _monitors(h.get("cumulative_monitors")),
    }


def _monitors(recorded: dict | None) -> dict:
    return {k: {"value": v["value"], "passed": v["passed"], "blocking": v.get("blocking", False)}
            for k, v in (recorded or {}).items()}


def _heldout_holey(evaluation: dict) -> float:
    from prodrl_pipelines.lab.arithmetic import heldout_tasks
    from prodrl_pipelines.lab.graders import anywhere, grade

    by_id = {t.task_id: t for t in heldout_tasks(len(evaluation["task_ids"]))}
    scores = [grade(by_id[tid].numbers, by_id[tid].ops, f["outputs"], anywhere)
              for tid, f in zip(evaluation["task_ids"], evaluation["facts"])]
    return sum(scores) / len(scores)


def walkthrough(home: Path, settings: dict, hack_rounds: int, fixed_rounds: int, log=print,
                via: str = "in_process") -> dict:
    """``hack_rounds`` rounds of the loop on ``settings`` with the holey grader, the fix, ``rescore``,
    then ``fixed_rounds`` on the exact grader; returns each round's row and the rescore report.
    ``via``: how lab traffic is served (``lab.http_traffic.TRAFFIC_MODES``)."""
    from dataclasses import asdict

    from prodrl_pipelines.lab.demo import run_loop
    from prodrl_pipelines.loop import scoring
    from prodrl_pipelines.resources.settings import make_resources, open_services

    def svc_for(s: dict):
        res = make_resources({**s, "home": str(home)})
        return open_services(res["settings"], res["store"])

    holey = {**settings, "rewards_sources": ["grader"], "rewards_grader": HOLEY}
    log(f"phase 1: {hack_rounds} rounds scored by the holey grader ({HOLEY})")
    run_loop(home, holey, hack_rounds, log, via=via)
    svc = svc_for(holey)
    base = svc.ledger.round_summary("round-000000")
    rounds = [round_row(svc, k) for k in _round_keys(svc)]
    fixed = {**holey, "rewards_grader": EXACT}
    svc = svc_for(fixed)
    rep = scoring.rescore(svc, "grader")
    log(f"fix: rewards_grader={EXACT}; {rep.summary()}")
    log(f"phase 2: {fixed_rounds} rounds on the fixed grader")
    if fixed_rounds:
        run_loop(home, fixed, fixed_rounds, log, via=via)
    done = {r["round"] for r in rounds}
    rounds += [round_row(svc, k) for k in _round_keys(svc) if k not in done]
    return {"base_heldout_reward": base.get("heldout_reward"), "rounds": rounds, "rescore": asdict(rep)}


def _round_keys(svc) -> list[str]:
    return [f"round-{h['round']:06d}" for h in svc.ledger.round_summaries() if h["round"] > 0 and "gate_passed" in h]


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_walkthrough(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="reward hacking: a grader with a hole, caught, fixed, re-scored")
    for c in ("round", "grader", "trained on", "exact on same", "hedges", "held-out (cand / live)",
              "holey grader on held-out (cand / live)", "monitors failing (vs live)",
              "cumulative failing (vs reference)", "gate", "deployed"):
        t.add_column(c)
    for r in out["rounds"]:
        t.add_row(r["round"], r["grader"], _f(r["trained_reward"]), _f(r["exact_reward"]),
                  f"{r['hedge_rate']:.1%}", f"{_f(r['heldout_reward'])} / {_f(r['live_heldout_reward'])}",
                  f"{_f(r['heldout_holey'])} / {_f(r['live_heldout_holey'])}", failing(r["monitors"]),
                  failing(r.get("cumulative_monitors") or {}, r.get("reference")),
                  "passed" if r["gate_passed"] else "FAILED", "yes" if r["deployed"] else "no")
    Console(width=180).print(t)


def failing(monitors: dict, reference: str | None = None) -> str:
    """The failing monitors of a round row, ``name +value`` each (and the reference they compare with)."""
    bad = ", ".join(f"{k} {v['value']:+.3f}" for k, v in monitors.items() if not v["passed"])
    return f"{bad} (vs {reference})" if bad and reference else bad or "-"


def walkthrough_settings(slow_drift: bool = False) -> tuple[dict, int, int]:
    """The command's settings, hack rounds and fixed rounds (``--slow-drift``: its variant)."""
    from prodrl_pipelines.lab.demo import DEMO_SETTINGS

    if slow_drift:
        return {**DEMO_SETTINGS, **WALKTHROUGH_SETTINGS, **SLOW_DRIFT_SETTINGS}, 8, 0
    return {**DEMO_SETTINGS, **WALKTHROUGH_SETTINGS}, 4, 3


def cmd_reward_hacking(args) -> int:
    settings, hack, fixed = walkthrough_settings(args.slow_drift)
    if args.settings:
        settings.update(json.loads(Path(args.settings).read_text()))
    home = Path(args.runs_dir).resolve() / args.name
    t0 = time.time()
    hack = args.hack_rounds if args.hack_rounds is not None else hack
    fixed = args.fixed_rounds if args.fixed_rounds is not None else fixed
    out = walkthrough(home, settings, hack, fixed, via=args.traffic)
    print_walkthrough(out)
    path = home / "reward_hacking.json"
    path.write_text(json.dumps({**provenance(sys.argv[1:]), "settings": settings, "traffic": args.traffic, **out,
                                "seconds": round(time.time() - t0, 1)}, indent=1, default=str))
    print(f"wrote {path} ({time.time() - t0:.0f}s)")
    return 0


def add_reward_hacking_parser(lab_sub) -> None:
    p = lab_sub.add_parser("reward-hacking", help="the walkthrough: a grader with a hole, monitors, gate, rescore")
    p.add_argument("--name", default="reward-hacking")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--hack-rounds", type=int, default=None, help="rounds on the holey grader (default 4; 8 with --slow-drift)")
    p.add_argument("--fixed-rounds", type=int, default=None, help="rounds after the fix (default 3; 0 with --slow-drift)")
    p.add_argument("--slow-drift", action="store_true",
                   help="the demo's learning rate: the hack grows under every per-round threshold and deploys; "
                        "the cumulative monitors against round 0 catch it")
    p.add_argument("--traffic", choices=("in_process", "http-seeded", "http"), default="in_process",
                   help="how lab traffic is served: in_process and http-seeded are reproducible; http batches "
                        "concurrent calls, so two runs differ")
    p.add_argument("--settings", help="JSON file of ProdRLSettings overrides (e.g. lab_size, lab_hedge_noise)")
    p.set_defaults(fn=cmd_reward_hacking)
