"""The settings checked before any work, as a whole: ``config.settings.check_settings`` and what needs the
base model's source (which lives on this floor): an adapter target that cannot serve its adapters on
that model."""

from __future__ import annotations

from prodrl_pipelines.config.settings import Settings, check_settings


def check_before_work(settings: Settings, s3_endpoint_url: str | None = None):
    """``check_settings`` (returns the suite), then the base model against the deploy target."""
    suite = check_settings(settings, s3_endpoint_url)
    refused = adapters_unservable(settings)
    if refused:
        raise ValueError(refused)
    return suite


def adapters_unservable(settings: Settings) -> str | None:
    """Why the deploy target cannot serve this recipe's adapters here (None: it can): vLLM's CPU build
    serves LoRA on dense models only, so a LoRA recipe on an MoE base with ``vllm-lora`` and no GPU."""
    if settings.recipe.training != "lora" or settings.deploy.target != "vllm-lora":
        return None
    from prodrl_pipelines.deploy_targets.servers import cuda_available
    from prodrl_pipelines.loop.model_source import source_is_moe

    if source_is_moe(settings.base_model, settings) and not cuda_available():
        lab = f" (lab size {settings.lab.size!r})" if settings.base_model.partition(":")[0] == "lab" else ""
        return (f"training 'lora' with deploy target 'vllm-lora' on base_model {settings.base_model!r}{lab}, a mixture "
                "of experts: vLLM serves LoRA on MoE layers with GPU kernels only "
                "and this host has no GPU; use deploy target 'prodrl-serve-lora', a dense model, or a GPU")
    return None
