"""What `prodrl serve` serves: the loaded engine, the model's facts (eos tokens, sampling defaults, limits), token strings."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prodrl_pipelines.engines.batching import EngineBatcher
from prodrl_pipelines.engines.serve_metrics import ServeMetrics


# ----------------------------------------------------------------------------- model state


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class ModelInfo:
    """What the server needs to know about the loaded checkpoint besides the engine."""

    name: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    defaults: dict[str, float]  # sampling defaults from generation_config.json (may be empty)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, engine, model_dir: str | None, name: str, generation_config: str = "auto") -> ModelInfo:
        cfg = getattr(getattr(engine, "model", None), "config", None)
        max_len = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 30
        vocab = int(getattr(engine, "vocab_size", 0) or getattr(cfg, "vocab_size", 0) or 0)
        eos: set[int] = set()
        gen = _read_json(Path(model_dir) / "generation_config.json") if model_dir else {}
        for source in (gen.get("eos_token_id"), getattr(getattr(engine, "tokenizer", None), "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, list):
                eos.update(int(x) for x in source)
        defaults = {}
        if generation_config == "auto":
            defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}
        return cls(name, str(model_dir or ""), max_len, vocab, frozenset(eos), defaults)


class TokenDecoder:
    """Cached per-token strings (vLLM: ``tokenizer.decode([id])``) and text decoding."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._cache: dict[int, str] = {}

    def piece(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self.tok.decode([tid]) if self.tok is not None else ""
            self._cache[tid] = s
        return s

    def text(self, ids: Sequence[int], skip_special: bool) -> str:
        if self.tok is None or not ids:
            return ""
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)


def load_engine(model_dir: str | os.PathLike, device: str = "cpu"):
    from prodrl_pipelines.engines.local import LocalEngine

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
    return LocalEngine.from_pretrained(path, device=device)


class ServeState:
    def __init__(self, engine, info: ModelInfo, *, max_logprobs: int, api_key: str | None,
                 batch_wait_ms: float, max_batch_size: int, generation_config: str, device: str,
                 batch_quiet_ms: float = 1.0, max_body_bytes: int | None = None,
                 return_routed_experts: bool = False) -> None:
        from prodrl_pipelines.engines.openai_protocol import MAX_BODY_BYTES

        self.batcher = EngineBatcher(engine, batch_wait_ms, max_batch_size, batch_quiet_ms)
        # vLLM's metric names (/metrics); the batcher tells it when requests queue, run and end
        self.metrics = self.batcher.metrics = ServeMetrics(lambda: self.info.name)
        self.max_body_bytes = int(max_body_bytes or MAX_BODY_BYTES)
        self.info = info
        self.loading: str | None = None  # the model directory /v1/load_model is loading (readiness says so)
        self.tokens = TokenDecoder(getattr(engine, "tokenizer", None))
        self.max_logprobs = int(max_logprobs)
        self.api_key = api_key
        self.generation_config = generation_config
        self.device = device
        # vLLM's --enable-return-routed-experts: each choice carries the experts of its forwarded
        # positions (MoE models only; a dense model answers null)
        self.return_routed_experts = bool(return_routed_experts)
        # the model's reasoning and tool-call format (``reply_parsers.ToolFormat``; None: plain replies)
        self.tool_format = None

    @property
    def engine(self):
        return self.batcher.engine
