"""Engine-neutral request/response types shared by the local engine, the vLLM client and the lab."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters as served. ``top_k = 0`` and ``top_p = 1.0`` mean "off"."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    # K: how many of the most likely processed tokens to record per generated position.
    num_top_logprobs: int = 8
    stop_token_ids: tuple[int, ...] = ()
    # Also draw one extra, independent token a' ~ mu per position (not fed back): the `sampled`
    # score-centering estimator uses it. Off by default (it consumes random numbers).
    record_extra_draw: bool = False
    # MoE: record the experts every forwarded position was routed to (``CallRecord.routed_experts``)
    record_routing: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.num_top_logprobs < 1:
            raise ValueError(f"SamplingParams.num_top_logprobs must be >= 1, got {self.num_top_logprobs}")


@dataclass
class CallRecord:
    """What one model call consumed and produced, exactly as the engine saw it (DESIGN.md s.3)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]  # processed log mu(a|h) of each sampled token
    top_token_ids: list[list[int]]  # K most likely processed tokens per generated position
    top_logprobs: list[list[float]]
    support_complete: bool  # the recorded head holds the whole sampling support at every position
    extra_token_ids: list[int] | None = None  # one extra draw a' ~ mu per position (when asked)
    finish_reason: str = "length"  # "stop" when a stop token was sampled (it is kept in the output)
    output_text: str = ""
    extra: dict = field(default_factory=dict)
    # MoE, when asked: the experts chosen per forwarded position (prompt + output - 1) and MoE layer,
    # [positions, layers, k] (numpy), covering positions from ``routed_experts_start``
    routed_experts: Any = None
    routed_experts_start: int = 0


class Engine(Protocol):
    """What plays an episode: token ids in, sampled calls (ids, logprobs) out."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[CallRecord]: ...
