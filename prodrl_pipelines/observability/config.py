"""``observability`` settings: where the trainer's rank 0 serves its Prometheus metrics."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ObservabilitySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # while a round trains, its rank 0 (in-process, torchrun or Ray Train) serves /metrics here
    # (observability.trainer_metrics); 0: off. A port taken (another round training on this host) is
    # said in the round's log and training goes on without it.
    trainer_metrics_port: int = Field(0, ge=0, le=65535)
    # the address it listens on: loopback by default; 0.0.0.0 where a scraper on another host reads it
    trainer_metrics_host: str = "127.0.0.1"
    # after the round's last step, wait up to this long for one more scrape, so that its final values
    # reach Prometheus (a round shorter than a scrape interval is otherwise never seen); 0: no wait
    trainer_metrics_final_scrape_s: float = Field(0.0, ge=0)
