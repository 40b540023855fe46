"""The behaviour monitors' settings: a threshold and a blocking/warning switch per monitor."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

# a refusal, or a question back instead of an answer (Cursor's "clarifying questions instead of edits")
DEFAULT_REFUSAL_PATTERN = (
    r"(?i)(\b(could|can) you (please )?(clarify|specify|confirm)\b|\bwhat do you mean\b|\bi can(no|')t help\b"
    r"|\bi(?:'m| am) (sorry|unable)\b|\bas an ai\b|\?\s*$)"
)


class MonitorSettings(BaseModel):
    """Each monitor compares the candidate's held-out episodes with the live policy's on the same
    tasks (``evaluation.monitors``). ``*_blocking``: a failure blocks the deploy (else a warning)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: tuple[str, ...] = ("format_errors", "length_drift", "refusal_rate", "kl", "slices")
    # candidate - live rate of calls with a format or tool-call parse error
    format_errors_threshold: float = Field(0.05, ge=0)
    format_errors_blocking: bool = True
    # |mean generated tokens per episode, candidate / live - 1|
    length_drift_threshold: float = Field(0.5, ge=0)
    length_drift_blocking: bool = False
    # candidate - live rate of calls matching ``refusal_pattern``
    refusal_rate_threshold: float = Field(0.05, ge=0)
    refusal_rate_blocking: bool = False
    refusal_pattern: str = DEFAULT_REFUSAL_PATTERN
    # KL(candidate || live) per generated token on the held-out prompts (sampled-token estimator)
    kl_threshold: float = Field(0.5, ge=0)
    kl_blocking: bool = False
    # per task tag: fails when a slice's mean(candidate - live) < -gate_tolerance and its upper bound < 0
    slices_blocking: bool = True
    slices_min_tasks: int = Field(8, ge=2)

    @field_validator("enabled")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from prodrl_pipelines.evaluation.monitors import MONITORS

        unknown = [m for m in v if m not in MONITORS]
        if unknown:
            raise ValueError(f"unknown monitor(s) {unknown}; known: {', '.join(MONITORS)}")
        return v

    @field_validator("refusal_pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        import re

        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return v
