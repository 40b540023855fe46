"""Typed training recipe (DESIGN.md section 4 defaults), validated before any work starts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def registered(name: str, registry, what: str) -> str:
    """``name`` when it is a key of the registry dict it chooses from, else a ValueError listing them."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; known: {sorted(registry)}")
    return name


class Recipe(BaseModel):
    """One round's training recipe. Defaults match DESIGN.md."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps_per_round: int = Field(8, ge=1, description="S: Adam steps per round (one per minibatch)")
    batch_size: int = Field(16, ge=2, description="B: trajectories per minibatch")
    learning_rate: float = Field(1e-4, gt=0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    correction: str = "none"
    baseline: str = "loo"
    normalize_adv_std: bool = False
    ema_decay: float = Field(0.9, ge=0, lt=1)
    kl_beta: float = Field(0.0, ge=0, description="beta of the sampled reverse-KL to pi_k; 0 disables")
    # correction parameters (DESIGN.md s.4)
    tis_cap: float = Field(2.0, gt=0, description="C of tis/ref_is")
    ppo_eps: float = Field(0.2, gt=0, lt=1)
    cis_lambda: float = Field(2.3, ge=0)
    cis_kappa: float = Field(5e-3, ge=0, le=1)
    icepop_low: float = Field(0.5, ge=0)
    icepop_high: float = Field(2.0, gt=0)
    gspo_eps_low: float = Field(3e-4, gt=0, lt=1)
    gspo_eps_high: float = Field(4e-4, gt=0)
    cispo_low: float = Field(0.0, ge=0)
    cispo_high: float = Field(2.0, gt=0)
    seq_mis_low: float = Field(0.905, ge=0, description="seq_mis: lowest geometric-mean pi_k/mu kept")
    seq_mis_high: float = Field(1.105, gt=0, description="seq_mis: highest geometric-mean pi_k/mu kept")
    logprob_chunk: int = Field(1024, ge=1, description="tokens per chunk of the vocab projection")
    max_tokens_per_microbatch: int = Field(8192, ge=16, description="per process: the input positions of one "
                                           "packed micro-batch; a minibatch's gradient is accumulated over them")
    merge_turns: bool = Field(True, description="train a trajectory's calls as one sequence where each prompt "
                              "extends the previous prompt + output ids (a new sequence where it does not)")
    checkpoint_every: int = Field(4, ge=0, description="in-round checkpoint every N steps (0 = off)")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in "
                                           "backward instead of keeping them (less memory, ~1/3 more compute)")
    max_policy_lag: Literal[0, 1] = 0
    replay: Literal["recorded", "retokenized"] = "recorded"
    routing_replay: Literal["none", "recorded"] = Field(
        "none", description="MoE: 'recorded' makes every MoE layer use the experts the deployment recorded "
        "at each position (R3; the mixing weights stay the trainer's router probabilities); a dense model "
        "or data without routing ignores it")
    seed: int = 0
    # LoRA (rl.lora): only adapters on the policy's linear layers train; the base stays frozen.
    # "LoRA Without Regret" (Thinking Machines, 2025): for RL, small ranks match full fine-tuning at
    # ~10x the learning rate; rank 8 is what vLLM's CPU build was measured serving (DESIGN.md s.10)
    training: Literal["full", "lora"] = Field("full", description="full: every weight trains; lora: PEFT "
                                              "adapters (rank lora_rank) on lora_target_modules, the base frozen")
    lora_rank: int = Field(8, ge=1, description="r of each adapter (a server's --max-lora-rank must allow it)")
    lora_alpha: float = Field(16.0, gt=0, description="alpha: the adapter's update is (alpha / r) B A")
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: tuple[str, ...] = Field(("all-linear",), description=(
        "['all-linear'] (every linear layer but the output head) or layer names (q_proj, ...); MoE experts "
        "are fused parameters and are refused"))

    @field_validator("lora_target_modules")
    @classmethod
    def _adaptable(cls, v):
        from prodrl_pipelines.rl.lora import check_target_modules

        check_target_modules(v)
        return v

    @field_validator("correction")
    @classmethod
    def _known_correction(cls, v: str) -> str:
        from prodrl_pipelines.rl.losses import POLICY_CORRECTIONS

        return registered(v, POLICY_CORRECTIONS, "correction")

    @field_validator("baseline")
    @classmethod
    def _known_baseline(cls, v: str) -> str:
        from prodrl_pipelines.rl.advantages import BASELINES

        return registered(v, BASELINES, "baseline")

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        if self.baseline == "loo" and self.steps_per_round * self.batch_size < 2:
            raise ValueError("baseline 'loo' needs at least 2 trajectories per round")
        for lo, hi in (("icepop_low", "icepop_high"), ("cispo_low", "cispo_high"), ("seq_mis_low", "seq_mis_high")):
            if getattr(self, lo) >= getattr(self, hi):
                raise ValueError(f"{lo} ({getattr(self, lo)}) must be below {hi} ({getattr(self, hi)})")
        return self

    def correction_params(self):
        from prodrl_pipelines.rl.losses import CorrectionParams

        return CorrectionParams(tis_cap=self.tis_cap, ppo_eps=self.ppo_eps, cis_lambda=self.cis_lambda,
                                cis_kappa=self.cis_kappa, icepop_low=self.icepop_low, icepop_high=self.icepop_high,
                                gspo_eps_low=self.gspo_eps_low, gspo_eps_high=self.gspo_eps_high,
                                cispo_low=self.cispo_low, cispo_high=self.cispo_high,
                                seq_mis_low=self.seq_mis_low, seq_mis_high=self.seq_mis_high)

    @property
    def needs_reference_model(self) -> bool:
        return self.correction == "ref_is"

    @property
    def trajectories_per_round(self) -> int:
        """S*B: each trajectory is used once per round."""
        return self.steps_per_round * self.batch_size
