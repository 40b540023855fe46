"""Everything a prod-RL loop is configured with, typed and validated before any work starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.rl.config import Recipe


class DeploySettings(BaseModel):
    """Sampling parameters the deployment serves with (recorded with every call)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(8, ge=1)
    num_top_logprobs: int = Field(8, ge=1, le=20)
    record_extra_draw: bool = False
    # what the deployment serves: NVFP4 weights (W4A16 data-free, W4A4 calibrated) or bf16
    export_scheme: Literal["nvfp4-w4a16", "nvfp4-w4a4", "bf16"] = "nvfp4-w4a16"

    @model_validator(mode="after")
    def _head_covers_top_k(self) -> "DeploySettings":
        if self.top_k and self.num_top_logprobs < self.top_k:
            raise ValueError(f"num_top_logprobs ({self.num_top_logprobs}) must be >= top_k ({self.top_k}) so the "
                             "recorded head holds the whole sampling support")
        return self

    def sampling(self, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.max_tokens,
                              self.num_top_logprobs, tuple(stop_token_ids), self.record_extra_draw)


class EvalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    heldout_size: int = Field(256, ge=2)
    eval_seed: int = 1234
    gate_tolerance: float = Field(0.05, ge=0)
    gate_z: float = Field(1.645, gt=0, description="one-sided 95% paired bound")


class LabSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    size: str = "demo"
    seed: int = 0
    sft_steps: int | None = None
    task: Literal["arithmetic", "chess"] = "arithmetic"  # the lab task environment (lab/tasks.py)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    home: str = ".prodrl"
    recipe: Recipe = Recipe()
    deploy: DeploySettings = DeploySettings()
    eval: EvalSettings = EvalSettings()
    lab: LabSettings = LabSettings()

    @model_validator(mode="after")
    def _sampled_needs_extra_draw(self) -> "Settings":
        if self.recipe.correction == "score_centering_sampled" and not self.deploy.record_extra_draw:
            raise ValueError("correction 'score_centering_sampled' needs deploy.record_extra_draw = true "
                             "(the deployment must record an extra draw per position)")
        return self

    @model_validator(mode="after")
    def _answers_fit_max_tokens(self) -> "Settings":
        from prodrl_pipelines.lab.tasks import get_task

        need = get_task(self.lab.task).min_max_tokens
        if self.deploy.max_tokens < need:
            raise ValueError(f"lab task {self.lab.task!r} needs deploy.max_tokens >= {need} (a correct answer is "
                             f"that long); got {self.deploy.max_tokens}")
        return self

    @property
    def home_path(self) -> Path:
        return Path(self.home).resolve()

    @property
    def store_root(self) -> Path:
        return self.home_path / "store"

    @property
    def checkpoints_root(self) -> Path:
        return self.home_path / "checkpoints"

    @property
    def exports_root(self) -> Path:
        return self.home_path / "exports"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.home_path / 'mlflow.db'}"

    @property
    def mlflow_artifacts(self) -> str:
        return (self.home_path / "mlartifacts").as_uri()
