"""The deployment gate: a paired non-inferiority test on the same held-out tasks, plus sanity.

The statistics (``decide``) and the round's step (``gate``): pass iff every weight is finite, the
export loaded and generated, the lower confidence bound of mean(candidate - live) over the paired
held-out tasks is >= -tolerance, and no blocking behaviour monitor failed (``evaluation.monitors``;
a non-blocking one that fails is a warning on the decision), neither against live (per round) nor
against the reference policy (cumulative: the last reviewed policy, or round 0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from prodrl_pipelines.evaluation.statistics import paired_confidence_interval
from prodrl_pipelines.loop.services import Services, ensure_local, upstream_json
from prodrl_pipelines.storage import keys


@dataclass
class GateDecision:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    mean_diff: float = float("nan")
    diff_lower: float = float("nan")
    diff_upper: float = float("nan")
    candidate_mean: float = float("nan")
    live_mean: float = float("nan")
    n_tasks: int = 0
    tolerance: float = float("nan")
    monitors: list[dict] = field(default_factory=list)  # evaluation.monitors.MonitorResult dicts
    warnings: list[str] = field(default_factory=list)  # non-blocking monitors that failed
    cumulative_monitors: list[dict] = field(default_factory=list)  # the same monitors against the reference
    reference_version: str | None = None

    def summary(self) -> str:
        numbers = (f"mean paired difference {self.mean_diff:+.4f} over {self.n_tasks} tasks, lower bound "
                   f"{self.diff_lower:+.4f} vs -tolerance {-self.tolerance:.4f} (candidate {self.candidate_mean:.4f}, "
                   f"live {self.live_mean:.4f})")
        warn = f"; warnings: {'; '.join(self.warnings)}" if self.warnings else ""
        return (f"passed: {numbers}{warn}" if self.passed
                else "failed: " + "; ".join(self.reasons) + f" [{numbers}]{warn}")


def decide(
    candidate_rewards: np.ndarray,
    live_rewards: np.ndarray,
    *,
    tolerance: float,
    z: float,
    nonfinite: dict[str, int],
    smoke_ok: bool,
    smoke_error: str = "",
    monitors: list[dict] | None = None,
    cumulative_monitors: list[dict] | None = None,
    reference_version: str | None = None,
) -> GateDecision:
    cand = np.asarray(candidate_rewards, dtype=np.float64)
    live = np.asarray(live_rewards, dtype=np.float64)
    if cand.shape != live.shape:
        raise ValueError(f"paired gate needs the same tasks: {cand.shape} vs {live.shape} rewards")
    reasons = []
    if nonfinite:
        names = ", ".join(f"{k} ({v})" for k, v in list(nonfinite.items())[:5])
        reasons.append(f"non-finite weights in {len(nonfinite)} tensors: {names}")
    if not smoke_ok:
        reasons.append(f"export failed to load/generate: {smoke_error}")
    m, lo, hi = (float("nan"),) * 3
    if cand.size >= 2 and np.all(np.isfinite(cand)):
        m, lo, hi = paired_confidence_interval(cand - live, z)
        if lo < -tolerance and m >= -tolerance and hi >= 0:  # no evidence either way: the suite is too small
            reasons.append(
                f"held-out evaluation too small to decide: mean(candidate - live) = {m:+.4f} but its lower "
                f"bound over {cand.size} tasks is {lo:+.4f} < -tolerance {-tolerance:.4f} (half-width "
                f"{m - lo:.4f}); more held-out tasks (heldout_size, the suite) or a larger gate_tolerance decide it"
            )
        elif lo < -tolerance:
            reasons.append(
                f"held-out reward regression: mean(candidate - live) = {m:+.4f}, lower bound {lo:+.4f} "
                f"< -tolerance {-tolerance:.4f}"
            )
    else:
        reasons.append("held-out evaluation produced no usable rewards")
    warnings = []
    for mon in monitors or []:
        if not mon["passed"]:
            (reasons if mon["blocking"] else warnings).append(f"monitor {mon['name']}: {mon['detail']}")
    for mon in cumulative_monitors or []:
        if not mon["passed"]:
            (reasons if mon["blocking"] else warnings).append(
                f"cumulative monitor {mon['name']} (vs reference {mon.get('against') or reference_version}): {mon['detail']}")
    return GateDecision(
        passed=not reasons, reasons=reasons, mean_diff=m, diff_lower=lo, diff_upper=hi,
        candidate_mean=float(cand.mean()) if cand.size else float("nan"),
        live_mean=float(live.mean()) if live.size else float("nan"), n_tasks=int(cand.size), tolerance=float(tolerance),
        monitors=list(monitors or []), warnings=warnings, cumulative_monitors=list(cumulative_monitors or []),
        reference_version=reference_version,
    )


# --- the round's step --------------------------------------------------------------------------
def heldout_verdict(svc: Services, ev: dict, nonfinite: dict | None = None) -> GateDecision:
    """The gate's paired test on a recorded evaluation (``nonfinite``: the export's bad tensors)."""
    from prodrl_pipelines.evaluation.statistics import paired_on

    s, cand, live = svc.settings, ev["candidate"], ev["live"]
    if cand:  # by task id: an evaluation stored before they were paired so may hold another order
        live = paired_on(live, cand["task_ids"])
    return decide(
        np.asarray(cand["rewards"]) if cand else np.asarray([]),
        np.asarray(live["rewards"]) if cand else np.asarray([]),
        tolerance=s.eval.gate_tolerance, z=s.eval.gate_z, nonfinite=nonfinite or {},
        smoke_ok=cand is not None and not ev["smoke_error"], smoke_error=ev["smoke_error"],
        monitors=ev.get("monitors") or [], cumulative_monitors=ev.get("cumulative_monitors") or [],
        reference_version=ev.get("reference_version"),
    )


def recorded_gate(decision: dict) -> GateDecision:
    from dataclasses import fields

    return GateDecision(**{f.name: decision[f.name] for f in fields(GateDecision) if f.name in decision})


def gate(svc: Services, rkey: str) -> tuple[GateDecision, bool]:
    """(decision, reproduced). The paired test against live on the recorded evaluation; a passing
    candidate then awaits deployment (``promotion: auto``) or review (``review``). A round with a
    decision returns it unchanged."""
    from prodrl_pipelines.quant.export import export_nonfinite

    recorded = svc.ledger.decision(rkey)
    if recorded is not None:
        return recorded_gate(recorded), True
    s = svc.settings
    ev = upstream_json(svc, keys.heldout(rkey))
    d = heldout_verdict(svc, ev, export_nonfinite(ensure_local(svc, "exports", rkey)))  # NVFP4 checked dequantized
    promotion = s.deploy.promotion
    review = "pending" if d.passed and promotion == "review" else "none"
    svc.ledger.record_decision(rkey, {**asdict(d), "deployed": False, "promotion": promotion, "review": review})
    svc.ledger.update_round(rkey, gate_passed=d.passed, gate_reasons=d.reasons, deployed=False, review=review,
                            gate_warnings=d.warnings, monitors=_by_name(d.monitors),
                            cumulative_monitors=_by_name(d.cumulative_monitors), monitor_reference=d.reference_version)
    return d, False


def _by_name(monitors: list[dict]) -> dict:
    return {m["name"]: {"value": m["value"], "passed": m["passed"], "blocking": m["blocking"],
                        "threshold": m["threshold"]} for m in monitors}
