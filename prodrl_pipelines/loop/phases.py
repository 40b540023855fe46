"""Where the time and memory of a long step went: wall seconds and peak resident memory per phase.

Each phase resets the process's resident-memory high-water mark first (Linux: ``/proc/self/clear_refs``
with ``5``), so its peak is its own, not an earlier phase's; where that is not possible the peak is the
process's so far (``ru_maxrss``) and says so.
"""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_bytes(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class PhaseMeter:
    """``with meter.phase("export"): ...`` records the phase's seconds and peak memory (MB)."""

    def __init__(self, phases: dict[str, dict[str, float]] | None = None) -> None:
        self.phases: dict[str, dict[str, float]] = dict(phases or {})

    @contextmanager
    def phase(self, name: str):
        own = _reset_peak()
        start_rss = _status_bytes("VmRSS") or 0
        t0 = time.monotonic()
        try:
            yield
        finally:
            peak = _peak_bytes()
            self.phases[name] = {"seconds": round(time.monotonic() - t0, 3), "peak_rss_mb": round(peak / 1e6, 1),
                                 "added_peak_mb": round(max(0, peak - start_rss) / 1e6, 1) if own else float("nan")}

    def metadata(self) -> dict[str, float]:
        """Flat ``<phase>_seconds`` / ``<phase>_peak_rss_mb`` entries (Dagster metadata, MLflow metrics)."""
        return {f"{name}_{k}": v for name, p in self.phases.items() for k, v in p.items() if k != "added_peak_mb"}

    def table(self) -> str:
        lines = [f"{'phase':<12} {'seconds':>9} {'peak RSS MB':>12} {'added MB':>9}"]
        lines += [f"{n:<12} {p['seconds']:>9.1f} {p['peak_rss_mb']:>12.0f} {p['added_peak_mb']:>9.0f}"
                  for n, p in self.phases.items()]
        return "\n".join(lines)
