"""The deployment gate's decision rule."""

import math

import numpy as np
import pytest
import torch

from prodrl_pipelines.evaluation.statistics import paired_confidence_interval
from prodrl_pipelines.loop.gate import decide
from helpers import count_nonfinite


def test_paired_interval_hand_computed():
    d = np.array([0.0, 1.0, 0.0, 1.0])
    m, lo, hi = paired_confidence_interval(d, z=2.0)
    half = 2.0 * np.std(d, ddof=1) / 2.0
    assert m == 0.5 and lo == pytest.approx(0.5 - half) and hi == pytest.approx(0.5 + half)


def test_pass_when_not_worse_beyond_tolerance():
    live = np.array([1, 0, 1, 0, 1, 0, 1, 0] * 8, dtype=float)
    d = decide(live.copy(), live, tolerance=0.05, z=1.645, nonfinite={}, smoke_ok=True)
    assert d.passed and d.mean_diff == 0 and d.reasons == []


def test_fail_on_clear_regression_with_numbers():
    live = np.ones(64)
    cand = np.r_[np.zeros(32), np.ones(32)]
    d = decide(cand, live, tolerance=0.05, z=1.645, nonfinite={}, smoke_ok=True)
    assert not d.passed and "regression" in d.reasons[0] and d.diff_lower < -0.05


def test_paired_beats_unpaired_noise():
    # Same tasks, correlated outcomes: a tiny uniform drop is within tolerance.
    rng = np.random.default_rng(0)
    live = (rng.random(256) < 0.5).astype(float)
    cand = live.copy()
    cand[:3] = 0.0
    assert decide(cand, live, tolerance=0.05, z=1.645, nonfinite={}, smoke_ok=True).passed


def test_nonfinite_and_smoke_failures_are_named():
    sd = {"a.weight": torch.tensor([1.0, float("nan"), float("inf")]), "b": torch.zeros(3), "i": torch.arange(3)}
    bad = count_nonfinite(sd)
    assert bad == {"a.weight": 2}
    d = decide(np.ones(4), np.ones(4), tolerance=0.1, z=1.645, nonfinite=bad, smoke_ok=False, smoke_error="boom")
    assert not d.passed
    assert any("a.weight (2)" in r for r in d.reasons) and any("boom" in r for r in d.reasons)


def test_gate_needs_paired_tasks():
    with pytest.raises(ValueError, match="same tasks"):
        decide(np.ones(3), np.ones(4), tolerance=0.1, z=1.645, nonfinite={}, smoke_ok=True)
    d = decide(np.array([]), np.array([]), tolerance=0.1, z=1.645, nonfinite={}, smoke_ok=False, smoke_error="x")
    assert not d.passed and math.isnan(d.mean_diff)


def test_a_cluster_that_lost_a_node_is_not_a_candidate_that_cannot_serve():
    """The held-out evaluation's errors: Ray losing a node, a worker or an actor's owner fails the
    step (retried), never the gate; an actor whose start raised (the export does not load) and any
    other error are the candidate's."""
    from ray.exceptions import ActorDiedError, NodeDiedError, RayTaskError, WorkerCrashedError

    from prodrl_pipelines.loop.evaluate import infrastructure_failure

    load_failed = RayTaskError("EpisodeWorker.__init__", "Traceback ...", ValueError("bad export"))
    assert infrastructure_failure(ActorDiedError())  # its owner's node crashed
    assert infrastructure_failure(NodeDiedError("node gone"))
    assert infrastructure_failure(WorkerCrashedError())
    assert not infrastructure_failure(ActorDiedError(load_failed))
    assert not infrastructure_failure(load_failed)
    assert not infrastructure_failure(ValueError("NaN logits"))
    assert not infrastructure_failure(RuntimeError("ActorDiedError in a message is not one"))
