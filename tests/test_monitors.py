"""Behaviour monitors beside the reward: each one failing a crafted bad candidate (blocking the gate,
or only warning), the sampled-token KL estimator against the closed form, per-slice regressions,
and the held-out shortfall warning."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest

from prodrl_pipelines.evaluation.monitor_config import MonitorSettings
from prodrl_pipelines.evaluation.monitors import MONITORS, episode_facts, run_monitors, sampled_token_kl
from prodrl_pipelines.lab.tasks import ARITHMETIC
from prodrl_pipelines.loop.gate import decide

N = 64


def evaluation(rewards, *, tokens=4, format_errors=0, refusals=0, calls=2, kl=0.01, tags=None):
    """A recorded evaluation (``evaluation.heldout.evaluate_policy``'s shape) with these per-episode facts."""
    n = len(rewards)
    tags = tags or [[f"turns={2 + i % 2}"] for i in range(n)]
    facts = [{"gen_tokens": tokens, "calls": calls, "format_errors": int(i < format_errors),
              "refusals": int(i < refusals), "tags": tags[i]} for i in range(n)]
    return {"rewards": list(rewards), "facts": facts, "kl_to_live": kl, "kl_tokens": n * tokens}


def rng_rewards(seed=0):
    return (np.random.default_rng(seed).random(N) < 0.5).astype(float)


LIVE = evaluation(rng_rewards())

# name -> a candidate that fails that monitor only (same rewards as live, so the paired gate passes)
BAD = {
    "format_errors": evaluation(rng_rewards(), format_errors=20),
    "length_drift": evaluation(rng_rewards(), tokens=9),
    "refusal_rate": evaluation(rng_rewards(), refusals=16),
    "kl": evaluation(rng_rewards(), kl=0.9),
}


def slice_regression():
    """The mean improves, but every turns=3 task gets worse: the slice monitor must catch it."""
    live = rng_rewards()
    cand = live.copy()
    tags = [[f"turns={2 + i % 2}"] for i in range(N)]
    for i in range(N):
        cand[i] = 1.0 if i % 2 == 0 else max(live[i] - 0.5, 0.0)
    return evaluation(cand, tags=tags), evaluation(live, tags=tags)


def gate_on(cand, live, settings):
    mons = [m.as_dict() for m in run_monitors(cand, live, settings, tolerance=0.05, z=1.645)]
    return decide(np.asarray(cand["rewards"]), np.asarray(live["rewards"]), tolerance=0.05, z=1.645,
                  nonfinite={}, smoke_ok=True, monitors=mons), mons


def all_blocking(**kw) -> MonitorSettings:
    return MonitorSettings(**{**{f"{n}_blocking": True for n in MONITORS}, **kw})


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_monitor_blocks_a_crafted_bad_candidate(name):
    d, mons = gate_on(BAD[name], LIVE, all_blocking())
    failing = [m["name"] for m in mons if not m["passed"]]
    assert failing == [name], mons
    assert not d.passed and len(d.reasons) == 1 and d.reasons[0].startswith(f"monitor {name}:")
    # the same failure as a warning: the gate passes and says so
    d, _ = gate_on(BAD[name], LIVE, all_blocking(**{f"{name}_blocking": False}))
    assert d.passed and d.warnings and d.warnings[0].startswith(f"monitor {name}:") and "warnings:" in d.summary()


def test_a_regression_on_one_slice_blocks_even_when_the_mean_improves():
    cand, live = slice_regression()
    assert np.mean(cand["rewards"]) > np.mean(live["rewards"])
    d, mons = gate_on(cand, live, MonitorSettings())
    sl = next(m for m in mons if m["name"] == "slices")
    assert not sl["passed"] and "regressed: turns=3" in sl["detail"] and "turns=2" in sl["detail"]
    assert not d.passed and d.reasons == [f"monitor slices: {sl['detail']}"]
    assert d.mean_diff > 0  # the paired test alone would have passed it


def test_a_slice_whose_bound_merely_crosses_the_tolerance_is_inconclusive_not_blocking():
    live = rng_rewards(1)
    cand = live.copy()
    cand[1:8:2] = 1.0 - cand[1:8:2]  # a few turns=3 tasks flip both ways: mean ~0, a wide bound
    d, mons = gate_on(evaluation(cand), evaluation(live), MonitorSettings())
    sl = next(m for m in mons if m["name"] == "slices")
    assert sl["passed"] and "inconclusive" in sl["detail"] and "regressed" not in sl["detail"], sl


def test_slices_too_small_to_judge_do_not_block():
    cand, live = slice_regression()
    d, mons = gate_on(cand, live, MonitorSettings(slices_min_tasks=N))
    sl = next(m for m in mons if m["name"] == "slices")
    assert sl["passed"] and "too few" in sl["detail"] and d.passed


def test_a_healthy_candidate_passes_every_monitor_and_disabled_ones_are_not_run():
    d, mons = gate_on(evaluation(rng_rewards()), LIVE, all_blocking())
    assert d.passed and all(m["passed"] for m in mons) and len(mons) == len(MONITORS)
    _, mons = gate_on(BAD["kl"], LIVE, MonitorSettings(enabled=("format_errors",)))
    assert [m["name"] for m in mons] == ["format_errors"]


def test_sampled_token_kl_matches_the_closed_form():
    rng = np.random.default_rng(7)
    for _ in range(5):
        p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
        exact = float(np.sum(p * (np.log(p) - np.log(q))))
        a = rng.choice(6, size=200_000, p=p)
        kl, n, outside = sampled_token_kl(np.log(p)[a], np.log(q)[a])
        assert n == a.size and outside == 0
        se = float(np.std(np.log(p)[a] - np.log(q)[a]) / np.sqrt(a.size))
        assert abs(kl - exact) < 4 * se + 1e-9
    # a token the reference cannot sample is counted apart, not averaged in as -inf
    kl, n, outside = sampled_token_kl([-0.1, -0.2, -0.3], [-0.2, -np.inf, -0.1])
    assert (n, outside) == (2, 1) and kl == pytest.approx(((-0.1 + 0.2) + (-0.3 + 0.1)) / 2)


def test_episode_facts_see_format_and_tool_call_parse_errors_and_refusals():
    task = ARITHMETIC.generate_tasks(1, 0)[0]
    refusal = re.compile(MonitorSettings().refusal_pattern)
    texts = ["12", "12 13", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>",
             "Could you clarify what you mean?"]
    f = episode_facts(ARITHMETIC, task, texts, gen_tokens=17, refusal=refusal)
    # the arithmetic suite calls every non-integer malformed; the broken tool call is malformed anywhere
    assert f["format_errors"] == 4 and f["refusals"] == 1 and f["calls"] == 5 and f["gen_tokens"] == 17
    assert f["tags"] == [f"turns={task.n_turns}", f"first_op={task.ops[0]}"]

    class Plain:  # a suite without format_error: only the unparsable tool call counts
        pass

    assert episode_facts(Plain(), task, texts, 17, refusal)["format_errors"] == 1


def test_the_gate_says_when_the_suite_is_too_small_to_decide():
    live = np.array([1.0, 0.0, 1.0, 0.0])
    cand = np.array([1.0, 1.0, 0.0, 0.0])
    d = decide(cand, live, tolerance=0.05, z=1.645, nonfinite={}, smoke_ok=True)
    assert not d.passed and "too small to decide" in d.reasons[0] and "over 4 tasks" in d.reasons[0]


def test_heldout_size_beyond_the_suite_warns_naming_both_numbers(tmp_path, caplog, monkeypatch):
    from own_model import write_user_package

    from prodrl_pipelines.config.settings import check_settings, settings_from_flat
    from prodrl_pipelines.evaluation.heldout import heldout_tasks

    flat = {**write_user_package(tmp_path, n_tasks=16), "heldout_size": 256, "home": str(tmp_path / "h")}
    # this test's own `mygrader` (the examples' package of that name may be on sys.path), forgotten after
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mygrader", raising=False)
    settings = settings_from_flat(flat)
    suite = check_settings(settings)
    with caplog.at_level(logging.WARNING):
        assert len(heldout_tasks(settings, suite)) == 16
    assert "heldout_size=256" in caplog.text and "only 16 held-out tasks" in caplog.text
    f = tmp_path / "settings.json"
    f.write_text(json.dumps(flat))
    out = subprocess.run([sys.executable, "-m", "prodrl_pipelines.cli", "check-settings", str(f)],
                         capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                        "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "warning: heldout_size=256" in out.stderr and "only 16" in out.stderr
    assert json.loads(out.stdout)["heldout_tasks"] == 16
    sys.modules.pop("mygrader", None)
