"""The lab as one user of the production plug points (entry points in pyproject.toml).

- evaluation suite ``lab`` (group ``prodrl_pipelines.eval_suites``): ``eval.suite: lab`` is the lab
  task of the settings (``lab.task``), ``lab:arithmetic`` / ``lab:chess`` name one;
- model source ``lab`` (group ``prodrl_pipelines.model_sources``): ``base_model: lab`` builds the
  lab's toy Qwen3 (tokenizer trained locally, SFT warm start) with the ``lab`` settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def lab_suite(name: str, settings=None):
    from prodrl_pipelines.lab.tasks import get_task

    return get_task(name or (settings.lab.task if settings is not None else "arithmetic"))


@dataclass
class LabModelSource:
    size: str = "demo"
    seed: int = 0
    sft_steps: int | None = None
    task: str = "arithmetic"
    hedge_noise: float = 0.0

    def build(self, dest: Path) -> None:
        from prodrl_pipelines.lab.warmstart import build_base_policy

        build_base_policy(dest, size=self.size, seed=self.seed, sft_steps=self.sft_steps, task=self.task,
                          hedge_noise=self.hedge_noise)

    def mixture_of_experts(self) -> bool:
        from prodrl_pipelines.lab.model import SIZES

        return SIZES.get(self.size, {}).get("arch") == "moe"


def lab_model_source(arg: str, settings=None) -> LabModelSource:
    """``lab`` (the settings' lab size) or ``lab:SIZE``."""
    lab = settings.lab if settings is not None else None
    return LabModelSource(size=arg or (lab.size if lab else "demo"), seed=lab.seed if lab else 0,
                          sft_steps=lab.sft_steps if lab else None, task=lab.task if lab else "arithmetic",
                          hedge_noise=lab.hedge_noise if lab else 0.0)
