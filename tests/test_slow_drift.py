"""Slow drift: the behaviour monitors against a second reference (the last reviewed policy, or round 0)
with cumulative thresholds, beside the per-round comparison with live.

Crafted evaluations: a format-error rate that grows by 4 points a round (under the per-round +0.05
every round) passes each round against live, and fails against the reference once it has grown by
more than the cumulative +0.10; the gate blocks it (or warns, per the monitor's blocking setting).
The reference moves only when a person approves a version, and leaves a version rolled back away
from.
"""

from __future__ import annotations

import numpy as np
import pytest

from prodrl_pipelines.evaluation.monitor_config import MonitorSettings
from prodrl_pipelines.evaluation.monitors import run_monitors
from prodrl_pipelines.loop.gate import decide

N = 200  # held-out episodes, one call each


def evaluation(error_rate: float, seed: int) -> dict:
    """A policy's held-out evaluation: ``error_rate`` of its calls are format errors (exactly), its
    rewards are the same on every task (the reward itself does not drift here)."""
    rng = np.random.default_rng(seed)
    bad = set(rng.permutation(N)[: round(error_rate * N)].tolist())
    facts = [{"gen_tokens": 4, "calls": 1, "format_errors": int(i in bad), "refusals": 0, "tags": [f"t{i % 2}"],
              "outputs": ["12"]} for i in range(N)]
    return {"task_ids": [f"task-{i}" for i in range(N)], "rewards": [0.5] * N, "facts": facts,
            "kl_to_live": 0.01, "kl_tokens": 4 * N, "kl_outside_live_support": 0}


def by_name(results) -> dict:
    return {r.name: r for r in results}


def test_a_drift_under_every_per_round_threshold_is_caught_against_the_reference():
    s = MonitorSettings()
    rates = [0.0, 0.04, 0.08, 0.12]  # +0.04 a round: each deployed version is the next one's live
    reference = evaluation(rates[0], 0)
    verdicts = []
    for k in range(1, len(rates)):
        cand, live = evaluation(rates[k], k), evaluation(rates[k - 1], k - 1)
        per_round = by_name(run_monitors(cand, live, s, 0.05, 1.96, against=f"round-{k - 1:06d}"))
        cumulative = by_name(run_monitors(cand, reference, s, 0.05, 1.96, scope="cumulative",
                                          against="round-000000"))
        assert all(r.passed for r in per_round.values()), per_round  # under every per-round threshold
        assert per_round["format_errors"].value == pytest.approx(0.04)
        assert cumulative["format_errors"].value == pytest.approx(rates[k])
        assert cumulative["format_errors"].threshold == s.format_errors_cumulative_threshold == 0.10
        assert cumulative["format_errors"].scope == "cumulative"
        assert cumulative["format_errors"].against == "round-000000"
        assert "vs reference round-000000" in cumulative["format_errors"].detail
        verdicts.append(cumulative["format_errors"].passed)
    assert verdicts == [True, True, False]  # +0.04, +0.08 pass; +0.12 > +0.10 is caught


@pytest.mark.parametrize("blocking", [True, False])
def test_the_gate_blocks_or_warns_on_a_cumulative_failure_per_the_monitor_setting(blocking):
    s = MonitorSettings(format_errors_blocking=blocking)
    cand, live, ref = evaluation(0.12, 3), evaluation(0.08, 2), evaluation(0.0, 0)
    per_round = [m.as_dict() for m in run_monitors(cand, live, s, 0.05, 1.96)]
    cumulative = [m.as_dict() for m in run_monitors(cand, ref, s, 0.05, 1.96, scope="cumulative",
                                                    against="round-000000")]
    d = decide(np.asarray(cand["rewards"]), np.asarray(live["rewards"]), tolerance=0.05, z=1.96, nonfinite={},
               smoke_ok=True, monitors=per_round, cumulative_monitors=cumulative, reference_version="round-000000")
    said = "cumulative monitor format_errors (vs reference round-000000)"
    if blocking:
        assert not d.passed and any(r.startswith(said) for r in d.reasons), d.reasons
    else:
        assert d.passed and any(w.startswith(said) for w in d.warnings), d.warnings
    assert d.reference_version == "round-000000" and len(d.cumulative_monitors) == len(s.enabled)


def test_every_monitor_has_a_cumulative_threshold_of_its_own():
    s = MonitorSettings(kl_threshold=0.5, kl_cumulative_threshold=2.0, length_drift_cumulative_threshold=0.9,
                        refusal_rate_cumulative_threshold=0.2, slices_cumulative_threshold=0.3)
    cand, ref = evaluation(0.0, 1), evaluation(0.0, 0)
    cand = {**cand, "kl_to_live": 1.0}  # above the per-round KL threshold, under the cumulative one
    got = by_name(run_monitors(cand, ref, s, 0.05, 1.96, scope="cumulative", against="round-000000"))
    assert {n: r.threshold for n, r in got.items()} == {
        "format_errors": 0.10, "length_drift": 0.9, "refusal_rate": 0.2, "kl": 2.0, "slices": -0.3}
    assert got["kl"].passed and not by_name(run_monitors(cand, ref, s, 0.05, 1.96))["kl"].passed
    # the cumulative KL is the candidate's KL to the reference when given, not its KL to live
    far = by_name(run_monitors(cand, ref, s, 0.05, 1.96, scope="cumulative", against="round-000000",
                               kl_fields={"kl_to_live": 3.0, "kl_tokens": 800, "kl_outside_live_support": 0}))
    assert far["kl"].value == 3.0 and not far["kl"].passed


def test_cumulative_slices_use_their_own_tolerance():
    s = MonitorSettings(slices_cumulative_threshold=0.10)
    ref = evaluation(0.0, 0)
    live = {**evaluation(0.0, 1), "rewards": [0.5 - 0.075 * (i % 2) for i in range(N)]}  # slice t1 lost 0.075
    cand = {**evaluation(0.0, 2), "rewards": [0.5 - 0.15 * (i % 2) for i in range(N)]}  # and 0.075 more
    per_round = by_name(run_monitors(cand, live, s, 0.08, 1.96))["slices"]
    cumulative = by_name(run_monitors(cand, ref, s, 0.08, 1.96, scope="cumulative", against="round-000000"))["slices"]
    assert per_round.passed and not cumulative.passed and "regressed: t1" in cumulative.detail
    assert cumulative.threshold == -0.10
    # never tighter than the gate's own tolerance
    wide = by_name(run_monitors(cand, ref, s, 0.2, 1.96, scope="cumulative", against="round-000000"))["slices"]
    assert wide.passed and wide.threshold == -0.2


# --- the reference policy ---------------------------------------------------------------------
class _Svc:
    def __init__(self, root):
        from prodrl_pipelines.loop.ledger import RoundLedger
        from prodrl_pipelines.storage.blobstore import LocalBlobStore

        self.ledger = RoundLedger(LocalBlobStore(root))


def _deploy(svc, version: str, review: str = "none", kind: str = "deploy") -> None:
    from prodrl_pipelines.loop.ledger import LiveDeployment

    if version != "round-000000" and kind == "deploy":
        svc.ledger.record_decision(version, {"passed": True, "review": review, "deployed": True})
    svc.ledger.deploy(LiveDeployment(version, f"/c/{version}", f"/e/{version}", kind=kind))


def test_the_reference_is_round_0_until_a_person_approves_a_version(tmp_path):
    from prodrl_pipelines.loop.evaluate import reference_version

    svc = _Svc(tmp_path)
    _deploy(svc, "round-000000")
    assert reference_version(svc) == "round-000000"
    _deploy(svc, "round-000001")  # promotion auto: deployed, nobody reviewed it
    _deploy(svc, "round-000002")
    assert reference_version(svc) == "round-000000"
    _deploy(svc, "round-000003", review="approved")  # a reviewer approved it: the reference moves
    assert reference_version(svc) == "round-000003"
    _deploy(svc, "round-000004")  # later unreviewed deploys keep it
    assert reference_version(svc) == "round-000003"
    _deploy(svc, "round-000005", review="approved")
    assert reference_version(svc) == "round-000005"
    _deploy(svc, "round-000003", kind="rollback")  # rolled back away from round 5: round 3 again
    assert reference_version(svc) == "round-000003"


# --- where a reviewer sees them -------------------------------------------------------------------
def _pair():
    s = MonitorSettings()
    cand, live, ref = evaluation(0.12, 3), evaluation(0.08, 2), evaluation(0.0, 0)
    return ([m.as_dict() for m in run_monitors(cand, live, s, 0.05, 1.96, against="round-000002")],
            [m.as_dict() for m in run_monitors(cand, ref, s, 0.05, 1.96, scope="cumulative", against="round-000000")])


def test_tags_review_cells_and_checks_show_both_comparisons():
    from dagster import AssetCheckSeverity

    from prodrl_pipelines.assets.monitor_checks import _result
    from prodrl_pipelines.cli.review import monitor_cell
    from prodrl_pipelines.loop.lineage_hooks import monitor_tags

    per_round, cumulative = _pair()
    tags = {**monitor_tags(per_round), **monitor_tags(cumulative, ".cumulative")}
    assert tags["monitor.format_errors"].startswith("passed (0.04")
    assert tags["monitor.format_errors.cumulative"] == "blocks (0.12; threshold 0.1; vs round-000000)"
    assert monitor_cell(per_round) == "ok" and monitor_cell(cumulative) == "format_errors:BLOCKS(+0.12)"
    res = _result("monitor_format_errors", per_round[0], cumulative[0], "round-000000")
    assert not res.passed and res.severity == AssetCheckSeverity.ERROR
    md = {k: getattr(v, "value", v) for k, v in res.metadata.items()}
    assert md["value"] == pytest.approx(0.04) and md["cumulative_value"] == pytest.approx(0.12)
    assert (md["threshold"], md["cumulative_threshold"], md["reference_version"]) == (0.05, 0.10, "round-000000")
    assert "cumulative vs reference round-000000" in res.description
