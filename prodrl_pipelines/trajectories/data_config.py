"""``data`` settings: how long recorded trajectories are kept."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DataSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # the store maintenance job erases trajectories whose last call is older than this many days
    # (trajectories.erasure, audited like an erasure on request); 0: kept until erased on request
    retention_days: float = Field(0.0, ge=0)
