"""Plots people look at (PNG bytes for MLflow artifacts and Dagster markdown metadata)."""

from __future__ import annotations

import base64
import io
from typing import Sequence



def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported when a plot is drawn (not by every process that
    loads the Dagster definitions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def reward_curve_png(rounds: Sequence[int], rewards: Sequence[float], ci: Sequence[float], passed: Sequence[bool]) -> bytes:
    """Held-out reward per round with its confidence interval, drawn once the round's gate has
    decided; hollow markers = the gate held the candidate back."""
    fig, ax = _pyplot().subplots(figsize=(5.5, 3.2))
    ax.errorbar(rounds, rewards, yerr=ci, fmt="-", color="tab:blue", capsize=3, lw=1.5)
    for r, y, d in zip(rounds, rewards, passed):
        ax.plot(r, y, "o", color="tab:blue", mfc="tab:blue" if d else "white")
    ax.set_xlabel("round")
    ax.set_ylabel("held-out reward")
    ax.set_title("held-out reward (filled = passed the gate)")
    ax.grid(alpha=0.3)
    return _png(fig)


def markdown_image(png: bytes, alt: str) -> str:
    """Inline PNG for Dagster MarkdownMetadataValue."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def mismatch_history_png(steps: Sequence[dict], round_starts: Sequence[int]) -> bytes:
    """The seed's three figures over the whole run: engine mismatch |log pi_k - log mu| (falls as
    the policy sharpens), staleness |log pi - log pi_k| (sawtooth: resets at each redeploy) and net
    |log pi - log mu|. Dotted lines mark round starts. When the steps carry ``staleness_steps``, a
    fourth panel shows the policy lag in optimizer steps (0..S-1 sync, S..2S-1 one-round async)."""
    keys = [("engine_mismatch", "engine |log pi_k - log mu|"), ("staleness", "staleness |log pi - log pi_k|"),
            ("net_mismatch", "net |log pi - log mu|")]
    if any("staleness_steps" in s for s in steps):
        keys.append(("staleness_steps", "policy lag (optimizer steps since the sampling policy)"))
    fig, axes = _pyplot().subplots(len(keys), 1, figsize=(6, 2.2 * len(keys)), sharex=True)
    xs = range(1, len(steps) + 1)
    for ax, (k, title) in zip(axes, keys):
        ax.plot(xs, [s.get(k, float("nan")) for s in steps], lw=1.3)
        for r in round_starts:
            ax.axvline(r + 0.5, color="grey", ls=":", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step (all rounds)")
    fig.tight_layout()
    return _png(fig)


def routing_png(stats: dict) -> bytes:
    """A round's MoE routing: per layer, the share of recorded expert sets the trainer's own router
    would not have chosen; and |log pi_k - log mu| (mean, p99) on the same tokens with and without
    replaying the recorded routing."""
    layers = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in stats.items() if k.startswith("routing_disagreement_layer_"))
    fig, (a, b) = _pyplot().subplots(1, 2, figsize=(9, 3.2))
    a.bar([i for i, _ in layers], [v for _, v in layers], color="tab:orange")
    a.axhline(stats["routing_disagreement"], color="grey", ls="--", lw=1, label=f"all layers {stats['routing_disagreement']:.1%}")
    a.set_xlabel("MoE layer")
    a.set_ylabel("share of positions")
    a.set_title("recorded experts != trainer's own top-k", fontsize=9)
    a.legend(fontsize=8)
    names = ["mean", "p99"]
    off = [stats.get(f"mismatch_no_replay_{n}", float("nan")) for n in names]
    on = [stats.get(f"mismatch_replay_{n}", float("nan")) for n in names]
    x = range(len(names))
    b.bar([i - 0.2 for i in x], off, 0.4, label="trainer's routing", color="tab:red")
    b.bar([i + 0.2 for i in x], on, 0.4, label="recorded routing (R3)", color="tab:green")
    b.set_xticks(list(x), names)
    b.set_title("|log pi_k - log mu| on tokens with recorded routing", fontsize=9)
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _png(fig)


def reward_distribution_png(rewards: dict[str, Sequence[float]], title: str = "rewards scored this round") -> bytes:
    """Histogram of the rewards each source gave (one colour per source)."""
    fig, ax = _pyplot().subplots(figsize=(5.5, 3.2))
    drawn = False
    for name, values in rewards.items():
        if len(values):
            ax.hist(list(values), bins=20, alpha=0.6, label=f"{name} (n={len(values)})")
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "nothing scored (all rewarded already, or no traffic)", ha="center", va="center",
                transform=ax.transAxes)
    else:
        ax.legend()
    ax.set_xlabel("reward")
    ax.set_ylabel("trajectories")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _png(fig)
