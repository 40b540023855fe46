"""Statistics of an ablation over seeds: per recipe, the final / best / worst / mean-over-rounds
held-out reward, its spread across seeds, collapsed seeds, gate failures and engine mismatch
(:func:`aggregate`), the config's claims checked on that table, and paired per-seed comparisons.
Missing values (None, NaN) are left out of every statistic."""

from __future__ import annotations

import math

from prodrl_pipelines.lab.ablation_config import AblationConfig


def _finite(xs) -> list[float]:
    return [float(x) for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]


def finite_mean(xs) -> float:
    """Mean of the finite values; NaN when there are none."""
    xs = _finite(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _sd(xs) -> float:
    """Sample standard deviation (ddof=1); NaN for fewer than 2 values."""
    xs = _finite(xs)
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def curve(result: dict) -> list[float]:
    """Held-out reward per round (index = round; round 0 = base); NaN where missing."""
    n = max((r["round"] for r in result["rounds"]), default=-1) + 1
    ys = [float("nan")] * n
    for r in result["rounds"]:
        y = r.get("heldout_reward")
        ys[r["round"]] = float(y) if y is not None else float("nan")
    return ys


def aggregate(cfg: AblationConfig, results: list[dict], failures: list[dict] | None = None) -> dict[str, dict]:
    """Per recipe: the table row. ``results`` = result.json documents.

    final = reward at the last round; best / worst = max / min over rounds >= 1; auc = mean over rounds
    >= 1; gain = final - base; sd = sample sd across seeds (ddof=1) -- ``gain_sd`` is the spread across
    seeds net of the base policies' own spread (each seed has its own base); jitter = mean over rounds
    t >= 2 of abs(reward_t - reward_{t-1}) (round-to-round volatility), averaged over seeds;
    collapsed = seeds meeting ``cfg.collapse``; gate_failures = rounds whose gate failed (all seeds);
    mismatch = mean over rounds and seeds of |log pi_k - log mu|.
    """
    failures = failures or []
    table: dict[str, dict] = {}
    for recipe in cfg.recipes:
        rs = sorted([r for r in results if r["recipe"] == recipe], key=lambda r: r["seed"])
        curves = [curve(r) for r in rs]
        finals = [c[-1] for c in curves]
        bases = [c[0] for c in curves]
        bests = [max(_finite(c[1:]), default=float("nan")) for c in curves]
        aucs = [finite_mean(c[1:]) for c in curves]
        worsts = [min(_finite(c[1:]), default=float("nan")) for c in curves]
        jitters = [finite_mean([abs(c[i] - c[i - 1]) for i in range(2, len(c))]) for c in curves]
        gates = sum(1 for r in rs for x in r["rounds"] if x["round"] > 0 and x.get("gate_passed") is False)
        mism = [x.get("mismatch_abs_logp") for r in rs for x in r["rounds"] if x["round"] > 0]
        table[recipe] = {
            "recipe": recipe, "seeds_ok": len(rs),
            "seeds_failed": sum(1 for f in failures if f["recipe"] == recipe and not f.get("missing")),
            "seeds_missing": sum(1 for f in failures if f["recipe"] == recipe and f.get("missing")),
            "seeds": [r["seed"] for r in rs],
            "base_mean": finite_mean(bases), "final_mean": finite_mean(finals), "final_sd": _sd(finals),
            "final_min": min(_finite(finals), default=float("nan")),
            "final_max": max(_finite(finals), default=float("nan")),
            "best_mean": finite_mean(bests), "worst_mean": finite_mean(worsts), "auc_mean": finite_mean(aucs),
            "gain_mean": finite_mean([f - b for f, b in zip(finals, bases)]),
            "gain_sd": _sd([f - b for f, b in zip(finals, bases)]), "jitter_mean": finite_mean(jitters),
            "collapsed": sum(1 for c in curves if cfg.collapse.collapsed(c)),
            "gate_failures": gates, "mismatch_mean": finite_mean(mism),
            "wall_s_mean": finite_mean([r.get("wall_s") for r in rs]),
            "cpu_s_mean": finite_mean([r.get("cpu_s") for r in rs]),
            **{f"retokenized_{k}": sum(int(r.get("retokenize", {}).get(f"retokenized_{k}", 0) or 0) for r in rs)
               for k in ("calls_differ", "calls", "multi_turn_calls", "multi_turn_calls_differ", "tokens_differ")},
        }
    return table


def check_claims(cfg: AblationConfig, table: dict[str, dict]) -> list[dict]:
    """Evaluate each claim on the table: ``holds`` True/False, or None when a side has no data."""
    ops = {">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}
    out = []
    for c in cfg.claims:
        a, b = table[c.lhs][c.metric], table[c.rhs][c.metric]
        ok = None if not (math.isfinite(a) and math.isfinite(b)) else bool(ops[c.op](a, b + c.margin))
        out.append({"text": c.text, "lhs": c.lhs, "rhs": c.rhs, "metric": c.metric, "op": c.op,
                    "margin": c.margin, "lhs_value": a, "rhs_value": b, "holds": ok})
    return out


def paired_diffs(results: list[dict], a: str, b: str) -> list[float]:
    """Per seed (both recipes finished): final reward of ``a`` minus that of ``b`` (same base policy)."""
    fa = {r["seed"]: curve(r)[-1] for r in results if r["recipe"] == a}
    fb = {r["seed"]: curve(r)[-1] for r in results if r["recipe"] == b}
    return [fa[s] - fb[s] for s in sorted(set(fa) & set(fb))]


def identical_pairs(cfg: AblationConfig, results: list[dict], tol: float = 1e-9) -> list[tuple[str, str, int]]:
    """Pairs of recipes of a comparison whose curves coincide on every seed both finished (>= 1 seed)."""
    by = {(r["recipe"], r["seed"]): curve(r) for r in results}
    out, seen = [], set()
    for members in cfg.comparisons.values():
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if (a, b) in seen:
                    continue
                seen.add((a, b))
                shared = [s for s in cfg.seeds if (a, s) in by and (b, s) in by]
                if shared and all(len(by[a, s]) == len(by[b, s]) and all(
                        abs(x - y) <= tol for x, y in zip(by[a, s], by[b, s])) for s in shared):
                    out.append((a, b, len(shared)))
    return out
