"""What a reward source answers for one trajectory."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """One trajectory's score: ``reward`` (None: unscored) and, when the source failed, ``error``."""

    reward: float | None
    error: str | None = None


def checked(value, where: str) -> Outcome:
    """A source's raw answer as an Outcome: None stays unscored; a non-number or non-finite is an error."""
    if value is None:
        return Outcome(None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return Outcome(None, f"{where} returned {type(value).__name__} {value!r}, expected a float or None")
    if not math.isfinite(float(value)):
        return Outcome(None, f"{where} returned the non-finite reward {value!r}")
    return Outcome(float(value))


def short_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]
