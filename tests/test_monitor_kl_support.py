"""The KL monitor judges the tokens outside the other policy's support: they have infinite KL and
are left out of the mean, so a candidate drifting out of live's support would otherwise report a
smaller KL the further it drifts."""

from __future__ import annotations

import math

from prodrl_pipelines.evaluation.monitor_config import MonitorSettings
from prodrl_pipelines.evaluation.monitors import kl, sampled_token_kl


def _cand(own: list[float], live: list[float]) -> dict:
    v, n, outside = sampled_token_kl(own, live)
    return {"kl_to_live": v, "kl_tokens": n, "kl_outside_live_support": outside}


def test_a_candidate_drifting_out_of_lives_support_fails_the_kl_monitor():
    s = MonitorSettings()
    # 100 tokens live also samples, with a small KL; then the same plus 20 tokens live never samples
    own, live = [-0.5] * 100, [-0.6] * 100
    inside = kl(_cand(own, live), {}, s, None)
    drifted = _cand(own + [-0.1] * 20, live + [-math.inf] * 20)
    assert drifted["kl_outside_live_support"] == 20 and drifted["kl_to_live"] <= inside.value + 1e-12
    out = kl(drifted, {}, s, None)
    assert inside.passed and not out.passed
    assert "20 tokens (16.67%) outside live's support" in out.detail


def test_the_outside_share_has_its_own_threshold():
    c = _cand([-0.5] * 99 + [-0.1], [-0.6] * 99 + [-math.inf])  # 1% outside
    assert kl(c, {}, MonitorSettings(kl_outside_support_threshold=0.01), None).passed
    assert not kl(c, {}, MonitorSettings(kl_outside_support_threshold=0.005), None).passed
