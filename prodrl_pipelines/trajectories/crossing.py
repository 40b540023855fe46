"""Episodes whose calls were recorded under several policy versions: which calls outside the
policy window a round looks at, and what they mean for training (DESIGN.md s.3 and s.5).

A trajectory's calls can land on different versions: during a rolling wave the balancer may send
call 0 to an updated replica and call 1 to one not yet updated; a canary that refuses connections
sends its slice back to the stable replicas; a client may send a stray name. A trajectory is
trained only when **every** call is under a version of the policy window. For the others:

* **Which calls are seen.** The window's partitions (all columns), and the key columns
  (``trajectory_id, call_index, policy_version, created_at``) of the calls recorded at or after
  the window's *first call* (``first_call_at``: the earliest ``created_at`` under the window's
  versions, retracted rows included) in the partition of the window's *predecessor* (the version
  before the window in the history: the one the window's first version replaced, which kept
  serving during that wave or canary) and in the partitions of versions not in the history
  (canaries, a version a wave is deploying, strays). Older partitions are never opened.
* **older** -- a call under the predecessor: the trajectory can never be whole in this window or a
  later one (the history only moves on): quarantined, ``crossed_versions``.
* **not in the history** (or after the live version in it) -- recorded at or after the live
  version's first call: the version may still enter the window (a running canary, a wave in
  progress), so the trajectory is *held back* (``pending_other_version``: neither eligible nor
  quarantined). Recorded before the live version's first call: another deployment came after it,
  so that version was passed over (a failed canary, a rolled-back wave, a stray) and the trajectory
  can no longer complete: quarantined, ``crossed_versions``. A live version without calls yet
  counts as having come after every call.
* Calls recorded before the window's first call under a version outside it are not read: they are
  the earliest calls of such a trajectory, so its calls in the window do not start at index 0 and
  validation quarantines it (``bad_call_index``). A trajectory with no call in the window is not
  read at all, like every older trajectory: it is never trained and gets no ledger row.

So during a rolling wave an in-flight episode that crosses from the old version to the new one is
held back while the new version is not yet in the history; once it is, the episode trains with
``max_policy_lag: 1`` (both versions in the window) and is quarantined with ``max_policy_lag: 0``.
The sensor (``eligibility``) sees the same calls and counts none of these trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from prodrl_pipelines.trajectories.rows import policy_window

CROSSED = "crossed_versions"


@dataclass(frozen=True)
class Window:
    """The policy window and what lies around it in the history (``version_order``)."""

    versions: list[str]
    live: str
    predecessor: str | None  # the version before the window in the history
    skipped: list[str]  # history versions before the predecessor: never read
    history: frozenset

    @classmethod
    def of(cls, live_version: str, version_order: list[str], max_policy_lag: int) -> Window:
        versions = policy_window(live_version, version_order, max_policy_lag)
        start = list(version_order).index(versions[0])
        pred = version_order[start - 1] if start > 0 else None
        return cls(versions, live_version, pred, list(version_order[: max(start - 1, 0)]),
                   frozenset(version_order))

    def role(self, version: str) -> str:
        """"inside", "older" (the predecessor, or skipped) or "other" (not in the history, or after live)."""
        if version in self.versions:
            return "inside"
        if version == self.predecessor or version in self.skipped:
            return "older"
        return "other"

    def outside_partitions_skipped(self) -> list[str]:
        """The partitions ``read_call_keys`` leaves out: the window's own (read in full) and the skipped ones."""
        return self.skipped + self.versions


def first_call_at(calls: pa.Table, versions: list[str], column: str = "created_at") -> int | None:
    """Earliest ``created_at`` (microseconds) of ``calls`` under ``versions``; None when there is none."""
    if calls.num_rows == 0:
        return None
    under = pc.is_in(calls.column("policy_version"), value_set=pa.array(versions, pa.string()))
    at = calls.column(column).cast(pa.int64()).filter(under)
    m = pc.min(at).as_py() if len(at) else None
    return None if m is None else int(m)


def classify(outside: pa.Table, window: Window, live_first_at: int | None) -> tuple[dict[str, str], set[str]]:
    """Per trajectory with a (non-retracted) call in ``outside`` (``read_call_keys`` rows): crossed
    (trajectory -> the reason's detail, for its lowest such call) and held back (the rest)."""
    crossed: dict[str, tuple[int, str]] = {}
    held: set[str] = set()
    at = outside.column("created_at").cast(pa.int64()).to_pylist()
    for tid, ci, v, a in zip(outside.column("trajectory_id").to_pylist(), outside.column("call_index").to_pylist(),
                             outside.column("policy_version").to_pylist(), at):
        role = window.role(v)
        if role == "inside":
            continue
        if role == "older":
            why = f"call {ci} policy_version={v!r} is older than the policy window {window.versions}"
        elif live_first_at is None or a < live_first_at:
            why = (f"call {ci} policy_version={v!r} is not in the history and was passed over: the live "
                   f"version {window.live!r} served its first call after it")
        else:
            held.add(tid)
            continue
        if tid not in crossed or ci < crossed[tid][0]:
            crossed[tid] = (int(ci), why)
    return {t: why for t, (_, why) in crossed.items()}, held - set(crossed)
