"""Behaviour monitors beside the reward: the candidate's held-out episodes against the live
policy's on the same tasks, each chosen by name (``MONITORS``) with a threshold and a switch
that makes its failure block the deploy or only warn.

A reward can rise for the wrong reason (a grader with a hole, a judge that likes long answers);
what the policy does then shows in its behaviour before it shows in the reward. Per episode the
evaluation records facts (``episode_facts``): generated tokens, calls, calls with a format or
tool-call parse error, calls that refuse or ask back, task tags; the monitors compare their rates.

- ``format_errors``: candidate - live rate of calls with a format error (the suite's optional
  ``format_error(task, text)``) or a ``<tool_call>`` block that does not parse;
- ``length_drift``: relative change of mean generated tokens per episode;
- ``refusal_rate``: candidate - live rate of calls matching ``refusal_pattern``;
- ``kl``: KL(candidate || live) per generated token, sampled-token estimator
  mean over the candidate's tokens of log pi_cand(a) - log pi_live(a) (unbiased for the KL of the
  sampling distributions; computed by ``loop.evaluate`` which holds both policies). Tokens live
  could never sample (outside its top-k / top-p support) have infinite KL and are left out of the
  mean, so their share is judged on its own (``kl_outside_support_threshold``): a candidate that
  drifts out of live's support would otherwise report a smaller KL;
- ``slices``: per task tag, the paired interval of mean(candidate - live): a slice regressed when
  its mean is below -tolerance and its upper bound below 0 (worse beyond the tolerance, and
  evidently worse). A regression on one slice fails even when the mean improves. A slice whose
  lower bound merely crosses -tolerance is reported as inconclusive: with several slices, per-slice
  non-inferiority would fail unchanged candidates by chance.

Two references. Each monitor runs against the live policy (``scope="round"``, the per-round
thresholds) and against the reference policy (``scope="cumulative"``: the last reviewed policy, or
round 0; ``<name>_cumulative_threshold``). A hack that grows by less than every per-round threshold
each round and is deployed round after round stays under the per-round monitors forever; against
the reference its drift adds up until the cumulative threshold catches it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from prodrl_pipelines.evaluation.statistics import paired_confidence_interval
from prodrl_pipelines.rewards.view import parsed_tool_calls


SCOPES = ("round", "cumulative")  # against live, against the reference policy


@dataclass
class MonitorResult:
    name: str
    passed: bool
    blocking: bool
    value: float
    threshold: float
    detail: str
    scope: str = "round"
    against: str = ""  # the policy version compared with

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def verdict(self) -> str:
        return "passed" if self.passed else ("BLOCKS" if self.blocking else "warning")


def task_tags(suite, task) -> list[str]:
    """A task's tags: the suite's ``task_tags(task)``, else the task's ``tags`` (attribute or field)."""
    fn = getattr(suite, "task_tags", None)
    if callable(fn):
        return [str(t) for t in fn(task) or ()]
    tags = getattr(task, "tags", None)
    if tags is None and isinstance(getattr(task, "data", None), dict):
        tags = task.data.get("tags")
    return [str(t) for t in tags or ()]


def episode_facts(suite, task, texts: list[str], gen_tokens: int, refusal: re.Pattern) -> dict:
    """What the monitors need of one played episode."""
    fmt = getattr(suite, "format_error", None)
    format_errors = 0
    for t in texts:
        bad = parsed_tool_calls(t) is None or (callable(fmt) and bool(fmt(task, t)))
        format_errors += int(bad)
    return {"gen_tokens": int(gen_tokens), "calls": len(texts), "format_errors": format_errors,
            "refusals": sum(1 for t in texts if refusal.search(t)), "tags": task_tags(suite, task),
            "outputs": list(texts)}  # what a reviewer reads, and what any grader can re-score


def _rate(ev: dict, key: str) -> float:
    facts = ev.get("facts") or []
    calls = sum(f["calls"] for f in facts)
    return sum(f[key] for f in facts) / calls if calls else 0.0


def _missing(name: str, cand: dict, live: dict) -> str | None:
    if not cand.get("facts") or not live.get("facts"):
        return f"{name}: no per-episode facts recorded for {'the candidate' if not cand.get('facts') else 'live'}"
    return None


def _rate_increase(name: str, fact: str, what: str, cand: dict, live: dict, s, label: str) -> MonitorResult:
    """Candidate - other rate of calls with ``fact``; fails above ``<name>_threshold``."""
    c, lv = _rate(cand, fact), _rate(live, fact)
    d, limit = c - lv, getattr(s, f"{name}_threshold")
    return MonitorResult(name, d <= limit, getattr(s, f"{name}_blocking"), d, limit,
                         f"{what} rate {c:.3f} vs {label} {lv:.3f} ({d:+.3f}, allowed +{limit:.3f})")


def format_errors(cand: dict, live: dict, s, gate, label: str = "live") -> MonitorResult:
    return _rate_increase("format_errors", "format_errors", "format/tool-call parse error", cand, live, s, label)


def length_drift(cand: dict, live: dict, s, gate, label: str = "live") -> MonitorResult:
    c = float(np.mean([f["gen_tokens"] for f in cand["facts"]]))
    lv = float(np.mean([f["gen_tokens"] for f in live["facts"]]))
    d = c / lv - 1.0 if lv > 0 else (0.0 if c == 0 else float("inf"))
    return MonitorResult("length_drift", abs(d) <= s.length_drift_threshold, s.length_drift_blocking, d,
                         s.length_drift_threshold,
                         f"mean generated tokens per episode {c:.1f} vs {label} {lv:.1f} ({d:+.1%}, allowed "
                         f"+/-{s.length_drift_threshold:.0%})")


def refusal_rate(cand: dict, live: dict, s, gate, label: str = "live") -> MonitorResult:
    return _rate_increase("refusal_rate", "refusals", "refusal / clarifying-question", cand, live, s, label)


def kl(cand: dict, live: dict, s, gate, label: str = "live") -> MonitorResult:
    """The KL over the tokens the other policy can sample, and the share it cannot: either fails."""
    v = cand.get("kl_to_live")
    if v is None:
        return MonitorResult("kl", True, s.kl_blocking, float("nan"), s.kl_threshold,
                             f"KL to {label} not measured (no candidate tokens scored by the {label} policy)")
    n, outside = int(cand.get("kl_tokens", 0)), int(cand.get("kl_outside_live_support", 0))
    share = outside / (n + outside) if n + outside else 0.0
    kl_ok, support_ok = v <= s.kl_threshold, share <= s.kl_outside_support_threshold
    detail = (f"KL(candidate || {label}) {v:.4f} nats per generated token over {n} tokens (allowed "
              f"{s.kl_threshold:.4f}); {outside} tokens ({share:.2%}) outside {label}'s support (infinite KL, "
              f"allowed {s.kl_outside_support_threshold:.2%})")
    if not support_ok:
        detail += f"; fails: the candidate samples outside {label}'s support"
    return MonitorResult("kl", kl_ok and support_ok, s.kl_blocking, float(v), s.kl_threshold, detail)


def slices(cand: dict, live: dict, s, gate, label: str = "live") -> MonitorResult:
    tol, z = gate
    by_tag: dict[str, list[int]] = {}
    for i, f in enumerate(cand["facts"]):
        for t in f["tags"]:
            by_tag.setdefault(t, []).append(i)
    cr, lr = np.asarray(cand["rewards"], np.float64), np.asarray(live["rewards"], np.float64)
    worst, failing, unsure, small, parts = float("inf"), [], [], [], []
    for tag in sorted(by_tag):
        idx = by_tag[tag]
        if len(idx) < s.slices_min_tasks:
            small.append(f"{tag} ({len(idx)})")
            continue
        m, lo, hi = paired_confidence_interval(cr[idx] - lr[idx], z)
        worst = min(worst, m)
        parts.append(f"{tag}: {m:+.3f} [{lo:+.3f}, {hi:+.3f}], n={len(idx)}")
        if m < -tol and hi < 0:
            failing.append(tag)
        elif lo < -tol:
            unsure.append(tag)
    if not parts:
        detail = "no task tag has enough tasks to judge" + (f" (too few: {', '.join(small)})" if small else "")
        return MonitorResult("slices", True, s.slices_blocking, float("nan"), -tol, detail)
    detail = ("; ".join(parts) + (f"; regressed: {', '.join(failing)}" if failing else "")
              + (f"; inconclusive (bound below -{tol:g}): {', '.join(unsure)}" if unsure else "")
              + (f"; too few tasks to judge: {', '.join(small)}" if small else ""))
    return MonitorResult("slices", not failing, s.slices_blocking, worst, -tol, detail)


def sampled_token_kl(own_logprobs, reference_logprobs) -> tuple[float, int, int]:
    """KL(own || reference) per token from tokens sampled by ``own``: mean(log own(a) - log ref(a)),
    unbiased for the per-token KL. Returns (kl, tokens used, tokens the reference gives
    probability 0: outside its top-k / top-p support, where the KL is infinite)."""
    own = np.asarray(own_logprobs, np.float64)
    ref = np.asarray(reference_logprobs, np.float64)
    finite = np.isfinite(own) & np.isfinite(ref)
    kl_value = float(np.mean(own[finite] - ref[finite])) if finite.any() else float("nan")
    return kl_value, int(finite.sum()), int((~finite).sum())


MONITORS: dict[str, Callable] = {"format_errors": format_errors, "length_drift": length_drift,
                                 "refusal_rate": refusal_rate, "kl": kl, "slices": slices}


def run_monitors(cand: dict, live: dict, settings, tolerance: float, z: float, *, scope: str = "round",
                 against: str = "", kl_fields: dict | None = None) -> list[MonitorResult]:
    """Every enabled monitor on a candidate's and another policy's evaluations (same tasks).

    ``scope="round"``: the other is the live policy, with the per-round thresholds and the gate's
    ``tolerance`` for slices. ``scope="cumulative"``: the other is the reference policy, with the
    ``*_cumulative_threshold`` settings, each never tighter than its per-round one. ``kl_fields``: the
    candidate's KL to that other policy (``kl_to_live``, ``kl_tokens``, ``kl_outside_live_support``
    keys), when it is not the candidate's own KL-to-live fields."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    s = settings if scope == "round" else settings.cumulative_view()
    tol = tolerance if scope == "round" else max(settings.slices_cumulative_threshold, tolerance)
    label = "live" if scope == "round" else f"reference {against}".rstrip()
    c = cand if kl_fields is None else {**cand, **kl_fields}
    out = []
    for name in settings.enabled:
        miss = _missing(name, c, live)
        if miss:
            r = MonitorResult(name, True, getattr(s, f"{name}_blocking"), float("nan"), float("nan"), miss)
        else:
            r = MONITORS[name](c, live, s, (tol, z), label=label)
        r.scope, r.against = scope, against
        out.append(r)
    return out
