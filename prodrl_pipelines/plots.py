"""Plots people look at (PNG bytes for MLflow artifacts and Dagster markdown metadata)."""

from __future__ import annotations

import base64
import io
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def reward_curve_png(rounds: Sequence[int], rewards: Sequence[float], ci: Sequence[float], deployed: Sequence[bool]) -> bytes:
    """Held-out reward per round with its confidence interval; hollow markers = gate held."""
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.errorbar(rounds, rewards, yerr=ci, fmt="-", color="tab:blue", capsize=3, lw=1.5)
    for r, y, d in zip(rounds, rewards, deployed):
        ax.plot(r, y, "o", color="tab:blue", mfc="tab:blue" if d else "white")
    ax.set_xlabel("round")
    ax.set_ylabel("held-out reward")
    ax.set_title("held-out reward (filled = deployed)")
    ax.grid(alpha=0.3)
    return _png(fig)


def step_series_png(series: dict[str, Sequence[float]], title: str, ylabel: str = "") -> bytes:
    """Several per-step series on one axis (e.g. engine mismatch, staleness, net mismatch)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for name, ys in series.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def markdown_image(png: bytes, alt: str) -> str:
    """Inline PNG for Dagster MarkdownMetadataValue."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
