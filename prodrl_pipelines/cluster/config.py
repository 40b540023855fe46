"""The cluster settings: how a round's heavy steps are executed, not what they compute.

Flat names beside the core settings (settings files, the Dagster resource, PRODRL_SETTINGS_JSON):
``cluster`` (``local`` | ``ray``), ``cluster_address`` (the Ray dashboard's job-submission URL),
per-job resources, placement and the runtime env. ``local`` is the default: no Ray is imported.
Importing this module imports neither Ray nor Dagster.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# how the ranks of one job are placed (Ray placement-group strategies)
PLACEMENTS = {"spread": "STRICT_SPREAD", "pack": "PACK", "any": "SPREAD"}


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    cluster: Literal["local", "ray"] = Field("local", description="local: this process; ray: a Ray cluster")
    cluster_address: str = Field("", description="the Ray dashboard (job submission) URL, e.g. http://127.0.0.1:8265")
    cluster_workers: int = Field(2, ge=1, description="Ray Train workers (training ranks) of a round's training job")
    cluster_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs each training worker reserves")
    cluster_gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each training worker reserves (NCCL when > 0)")
    cluster_placement: Literal["spread", "pack", "any"] = Field(
        "spread", description="spread: one rank per node (STRICT_SPREAD); pack: as few nodes as fit; any: best effort")
    cluster_eval_workers: int = Field(0, ge=0, description="Ray workers of the held-out evaluation (0: in-process)")
    cluster_scoring_workers: int = Field(0, ge=0, description="Ray Data actors scoring rewards (0: in-process)")
    cluster_runtime_env: str = Field("", description="JSON object: Ray runtime env of every job (env_vars, pip, ...)")
    cluster_python: str = Field("", description="the interpreter a job runs on the cluster (empty: this one, "
                                                "right for a local cluster; 'python' on an image with prodrl installed)")

    @field_validator("cluster_address")
    @classmethod
    def _http(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not the Ray dashboard's http(s) URL (job submission, e.g. http://127.0.0.1:8265)")
        return v

    @field_validator("cluster_runtime_env")
    @classmethod
    def _json_object(cls, v: str) -> str:
        if v:
            try:
                obj = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"is not JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"must be a JSON object (a Ray runtime env), got {type(obj).__name__}")
        return v

    @model_validator(mode="after")
    def _ray_needs_address(self) -> "ClusterSettings":
        if self.cluster == "ray" and not self.cluster_address:
            raise ValueError("cluster_address: cluster 'ray' needs the Ray dashboard URL (e.g. http://127.0.0.1:8265)")
        return self

    @property
    def on_ray(self) -> bool:
        return self.cluster == "ray"

    @property
    def placement_strategy(self) -> str:
        return PLACEMENTS[self.cluster_placement]

    def runtime_env(self) -> dict:
        return json.loads(self.cluster_runtime_env) if self.cluster_runtime_env else {}

    def check_reachable(self, timeout_s: float = 5.0) -> None:
        """A ``ray`` cluster answers at its address, or this fails naming it (before any work starts)."""
        if not self.on_ray:
            return
        import httpx

        url = f"{self.cluster_address}/api/version"
        try:
            r = httpx.get(url, timeout=timeout_s)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"cluster_address: the Ray cluster at {self.cluster_address} cannot be reached "
                             f"({type(e).__name__}: {e}); start it (`ray start --head --include-dashboard=true`) "
                             f"or set cluster 'local'") from None


CLUSTER_FIELDS = tuple(ClusterSettings.model_fields)


def cluster_settings(flat: dict) -> ClusterSettings:
    """The cluster settings among flat settings (other names ignored); a bad value fails naming it."""
    from pydantic import ValidationError

    try:
        return ClusterSettings(**{k: v for k, v in flat.items() if k in CLUSTER_FIELDS})
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = ".".join(str(x) for x in err["loc"]) or "cluster"
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(msg if msg.startswith(f"{where}:") or not err["loc"] and ":" in msg else f"{where}: {msg}")
        raise ValueError("; ".join(problems)) from None
