"""The recorder's counters (``/stats``) and its clock: thread-safe, shared by every part of it."""

from __future__ import annotations

import threading
import time
from collections import Counter


class Stats:
    """Thread-safe named counters (``inc``) and a snapshot (``as_dict``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def add_many(self, items) -> None:
        """``inc`` several counters under one lock: ``items`` is (name, n) pairs."""
        with self._lock:
            c = self._c
            for name, n in items:
                c[name] += n

    def count(self, *names: str, tenant: str | None = None) -> None:
        """``inc`` each name, and with a ``tenant`` its per-tenant twin ``tenant.<tenant>.<name>``."""
        self.add_many([(n, 1) for n in names] + [(f"tenant.{tenant}.{n}", 1) for n in names if tenant])

    def get(self, name: str) -> int:
        with self._lock:
            return self._c[name]

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._c.items()))


_clock_lock = threading.Lock()
_last_us = [0]


def now_us() -> int:
    """Wall-clock microseconds since the epoch, strictly increasing within the process."""
    t = time.time_ns() // 1000
    with _clock_lock:
        t = max(t, _last_us[0] + 1)
        _last_us[0] = t
    return t
