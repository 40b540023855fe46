"""The behaviour monitors' settings: a threshold and a blocking/warning switch per monitor."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

# a refusal, or a question back instead of an answer (Cursor's "clarifying questions instead of edits")
DEFAULT_REFUSAL_PATTERN = (
    r"(?i)(\b(could|can) you (please )?(clarify|specify|confirm)\b|\bwhat do you mean\b|\bi can(no|')t help\b"
    r"|\bi(?:'m| am) (sorry|unable)\b|\bas an ai\b|\?\s*$)"
)


CUMULATIVE = ("format_errors", "length_drift", "refusal_rate", "kl", "slices")


class MonitorSettings(BaseModel):
    """Each monitor compares the candidate's held-out episodes with the live policy's on the same
    tasks (``evaluation.monitors``). ``*_blocking``: a failure blocks the deploy (else a warning).

    With ``cumulative`` each monitor also compares the candidate with the reference policy (the last
    reviewed one, or round 0) against ``<name>_cumulative_threshold``: drift that stays under the
    per-round threshold every round adds up there. The blocking switch is the monitor's own."""

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
    # share of the candidate's sampled tokens the other policy could never sample (infinite KL)
    kl_outside_support_threshold: float = Field(0.01, ge=0, le=1)
    # per task tag: fails when a slice's mean(candidate - live) < -gate_tolerance and its upper bound < 0
    slices_blocking: bool = True
    slices_min_tasks: int = Field(8, ge=2)
    # against the reference policy (last reviewed, or round 0): the same measures, summed-up drift
    cumulative: bool = True
    format_errors_cumulative_threshold: float = Field(0.10, ge=0)
    length_drift_cumulative_threshold: float = Field(0.75, ge=0)
    refusal_rate_cumulative_threshold: float = Field(0.10, ge=0)
    kl_cumulative_threshold: float = Field(1.0, ge=0)
    slices_cumulative_threshold: float = Field(0.10, ge=0)  # tolerance per slice vs the reference (>= the gate's)

    def cumulative_view(self) -> "MonitorSettings":
        """These settings with each ``<name>_threshold`` replaced by its cumulative one, never tighter
        than the per-round one (drift against the reference includes this round's against live)."""
        return self.model_copy(update={f"{n}_threshold": max(getattr(self, f"{n}_cumulative_threshold"),
                                                             getattr(self, f"{n}_threshold"))
                                       for n in CUMULATIVE if n != "slices"})

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
