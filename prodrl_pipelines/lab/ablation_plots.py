"""Ablation plots in the style of the seed's figures: held-out reward vs round, one colour per recipe,
the mean over seeds as a thick line, the min-max band over seeds shaded, each seed a thin line.
The first recipe of a comparison is gray (the baseline), the next orange, as in the seed."""

from __future__ import annotations

import io
import math
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = ["tab:gray", "tab:orange", "tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown", "tab:pink"]
# one line style per recipe too, so recipes whose curves coincide stay visible on top of each other
STYLES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 2))]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _stats(curves: Sequence[Sequence[float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per round over seeds: (rounds, mean, min, max), ignoring NaNs; rounds with no value are dropped."""
    n = max((len(c) for c in curves), default=0)
    xs, mean, lo, hi = [], [], [], []
    for i in range(n):
        ys = [c[i] for c in curves if i < len(c) and c[i] is not None and math.isfinite(c[i])]
        if ys:
            xs.append(i)
            mean.append(sum(ys) / len(ys))
            lo.append(min(ys))
            hi.append(max(ys))
    return xs, mean, lo, hi


def comparison_png(curves: Mapping[str, Mapping[int, Sequence[float]]], title: str = "",
                   ylabel: str = "held-out reward") -> bytes:
    """``curves``: recipe -> seed -> reward per round (index = round)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for j, (recipe, per_seed) in enumerate(curves.items()):
        col, ls = COLOURS[j % len(COLOURS)], STYLES[j % len(STYLES)]
        cs = list(per_seed.values())
        for c in cs:
            pts = [(i, y) for i, y in enumerate(c) if y is not None and math.isfinite(y)]
            if pts:
                ax.plot(*zip(*pts), color=col, lw=0.7, alpha=0.45, ls=ls)
        xs, mean, lo, hi = _stats(cs)
        if xs:
            ax.fill_between(xs, lo, hi, color=col, alpha=0.18, lw=0)
            ax.plot(xs, mean, color=col, lw=2.2, ls=ls, label=f"{recipe} (n={len(cs)})")
        else:
            ax.plot([], [], color=col, lw=2.2, label=f"{recipe} (no runs)")
    ax.set_xlabel("round (redeployment)")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def finals_png(finals: Mapping[str, Sequence[float]], bases: Mapping[str, Sequence[float]] | None = None) -> bytes:
    """Final held-out reward per recipe: one dot per seed, the mean as a wide tick; base reward dashed."""
    names = list(finals)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(names) + 1.5), 3.6))
    for j, n in enumerate(names):
        ys = [y for y in finals[n] if y is not None and math.isfinite(y)]
        col = COLOURS[j % len(COLOURS)]
        if ys:
            ax.hlines(sum(ys) / len(ys), j - 0.3, j + 0.3, color=col, lw=3)
            ax.plot([j] * len(ys), ys, "o", color=col, ms=5, alpha=0.8)
    if bases:
        bs = [y for v in bases.values() for y in v if y is not None and math.isfinite(y)]
        if bs:
            ax.axhline(sum(bs) / len(bs), color="k", ls="--", lw=1, label="base (round 0, mean)")
            ax.legend(fontsize=8, loc="lower right")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("final held-out reward")
    ax.set_title("final held-out reward by recipe (dots = seeds, bar = mean)")
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)
