"""Which policy is live, in what order versions were deployed, and each round's decisions.

Small JSON documents on the same blob store as the trajectories (keys: ``keys``), so the sensor,
the assets and the demo all read one source of truth: the live deployment, the deployed versions
oldest first (for max_policy_lag), every deploy and rollback as an event, each round's decision
(gate, review, deployment: ``review.round_state``) and summary, and the held-out rewards per task of
each policy (reused as "live" later). A decided round's decision is never rewritten.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from prodrl_pipelines.loop.round_state import round_index
from prodrl_pipelines.storage import documents, keys

class DecidedError(RuntimeError):
    """A write that would change the recorded decision of a decided round."""


@dataclass
class LiveDeployment:
    policy_version: str
    checkpoint_dir: str
    export_dir: str
    model_version: str | None = None  # MLflow registry version
    deployed_at: str = ""
    kind: str = "deploy"  # deploy | rollback
    decided_by: str = ""  # who made it live: the gate (auto), a reviewer, a rollback's author


class RoundLedger:
    def __init__(self, blobs):
        self.blobs = blobs

    def _get(self, key: str, default=None):
        return documents.get_json(self.blobs, key) if self.blobs.exists(key) else default

    def _put(self, key: str, obj) -> None:
        documents.put_json(self.blobs, key, obj)

    def live(self) -> LiveDeployment | None:
        raw = self._get(keys.LIVE)
        return LiveDeployment(**raw) if raw else None

    def deploy(self, dep: LiveDeployment) -> None:
        """Make ``dep`` live and append it to the deployment events. A rollback moves its version to
        the end of the deployment order: the policy that served just before it is then its
        predecessor (one-round async reads its traffic as lag 1)."""
        dep.deployed_at = dep.deployed_at or datetime.now(timezone.utc).isoformat()
        history = [v for v in self.version_order() if v != dep.policy_version] + [dep.policy_version]
        if history != self.version_order():
            self._put(keys.HISTORY, history)
        events = self.events()
        if events and events[-1]["policy_version"] == dep.policy_version and dep.kind != "rollback":
            events[-1] = {**asdict(dep), "previous": events[-1].get("previous")}  # the same deploy, completed
        else:
            events.append({**asdict(dep), "previous": events[-1]["policy_version"] if events else None})
        self._put(keys.EVENTS, events)
        self._put(keys.LIVE, asdict(dep))

    def events(self) -> list[dict]:
        """Every deploy and rollback, oldest first (the live one last)."""
        return list(self._get(keys.EVENTS, []))

    def version_order(self) -> list[str]:
        return list(self._get(keys.HISTORY, []))

    def record_decision(self, rkey: str, decision: dict) -> None:
        """Write the round's decision; refused (``DecidedError``) once the round is decided."""
        from prodrl_pipelines.loop.round_state import describe_decision, is_decided

        cur = self.decision(rkey)
        if cur is not None and is_decided(cur):
            if cur == decision:
                return
            raise DecidedError(f"{rkey} is decided ({describe_decision(cur)}); its decision is never rewritten")
        self._put(keys.decision(rkey), decision)

    def decision(self, rkey: str) -> dict | None:
        return self._get(keys.decision(rkey))

    def update_round(self, rkey: str, **fields) -> dict:
        """Merge fields into the round's summary document."""
        cur = self._get(keys.summary(rkey), {"round": round_index(rkey)})
        cur.update(fields)
        self._put(keys.summary(rkey), cur)
        return cur

    def round_summary(self, rkey: str) -> dict:
        return self._get(keys.summary(rkey), {"round": round_index(rkey)})

    def round_summaries(self) -> list[dict]:
        docs = [k for k in self.blobs.list(keys.ROUNDS) if k.endswith("/summary.json")]
        return sorted((self._get(k) for k in docs), key=lambda d: d["round"])

    def record_eval(self, policy_version: str, payload: dict) -> None:
        self._put(keys.policy_eval(policy_version), payload)

    def eval(self, policy_version: str) -> dict | None:
        return self._get(keys.policy_eval(policy_version))
