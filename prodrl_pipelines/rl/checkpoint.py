"""Trainer checkpoints: a normal Hugging Face directory plus the state that carries across rounds.

``trainer_state.pt`` holds the Adam state, the global step (learning-rate schedule position) and
the baseline state, so the loop is one long training run, not a series of restarts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from prodrl_pipelines.storage.atomic import atomic_directory
from prodrl_pipelines.rl.advantages import BaselineState

TRAINER_STATE = "trainer_state.pt"


class CheckpointError(FileNotFoundError):
    """A checkpoint that is missing or incomplete; the message names the path."""


@dataclass
class TrainerState:
    global_step: int = 0
    rounds_trained: int = 0
    baseline: BaselineState = field(default_factory=BaselineState)
    optimizer: dict | None = None


def save_checkpoint(path: Path, model, tokenizer, optimizer: torch.optim.Optimizer | None, state: TrainerState,
                    *, model_state: dict | None = None, optimizer_state: dict | None = None,
                    extra: Callable[[Path], None] | None = None) -> Path:
    """Write the checkpoint atomically. ``model_state`` / ``optimizer_state``: the whole states of a
    sharded model and optimizer (``rl.sharding``), gathered by every rank, written by one. ``extra``
    writes more files into the directory before it appears (a LoRA round's adapter)."""
    path = Path(path)
    with atomic_directory(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
        tokenizer.save_pretrained(tmp)
        if optimizer_state is None:
            optimizer_state = optimizer.state_dict() if optimizer is not None else state.optimizer
        payload = {
            "global_step": state.global_step,
            "rounds_trained": state.rounds_trained,
            "baseline": asdict(state.baseline),
            "optimizer": optimizer_state,
        }
        torch.save(payload, tmp / TRAINER_STATE)
        if extra is not None:
            extra(tmp)
    return path


def load_policy(path: Path, dtype: torch.dtype = torch.float32):
    """Load model and tokenizer of a checkpoint/export directory (NVFP4 exports dequantized), computing in ``dtype``.

    NVFP4 exports load weights-only, W4A4 included: this is the trainer's view ("upcast deployment
    weights", e.g. the reference model of reference-model IS), not the deployment's. The deployment
    (``LocalEngine.from_pretrained``) additionally simulates W4A4 activation quantization, so for a W4A4
    export the two differ by design.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prodrl_pipelines.quant.nvfp4 import is_compressed_tensors_dir, load_nvfp4_model

    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"no checkpoint at {path} (config.json missing)")
    if is_compressed_tensors_dir(path):
        return load_nvfp4_model(path, dtype=dtype, simulate_activations=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def load_trainer_state(path: Path) -> TrainerState:
    f = Path(path) / TRAINER_STATE
    if not f.exists():
        return TrainerState()  # a base policy that was never RL-trained
    raw = torch.load(f, map_location="cpu", weights_only=False)
    return TrainerState(
        global_step=int(raw["global_step"]),
        rounds_trained=int(raw.get("rounds_trained", 0)),
        baseline=BaselineState(**raw.get("baseline", {})),
        optimizer=raw.get("optimizer"),
    )
