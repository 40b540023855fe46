"""Deploy targets: what makes an export live, chosen by name (``deploy.target``; DESIGN.md s.7).

``TARGETS`` maps each name to its class; every target follows ``base.DeployTarget`` (switch, then
commit after the parity probe, or rollback).
"""

from __future__ import annotations

from prodrl_pipelines.deploy_targets.base import DeployError, DeployTarget, Endpoint, EndpointFile, Switch
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file
from prodrl_pipelines.deploy_targets.command import CommandTarget, PointerTarget
from prodrl_pipelines.deploy_targets.adapters import ProdrlServeLoRATarget, VLLMLoRATarget
from prodrl_pipelines.deploy_targets.reload import VLLMReloadTarget
from prodrl_pipelines.deploy_targets.servers import ProdrlServeTarget, VLLMRestartTarget
from prodrl_pipelines.deploy_targets.weight_transfer import VLLMWeightTransferTarget

TARGETS: dict[str, type] = {
    "pointer": PointerTarget,
    "prodrl-serve": ProdrlServeTarget,
    "vllm-restart": VLLMRestartTarget,
    "vllm-reload": VLLMReloadTarget,
    "vllm-lora": VLLMLoRATarget,
    "prodrl-serve-lora": ProdrlServeLoRATarget,
    "vllm-weight-transfer": VLLMWeightTransferTarget,
    "command": CommandTarget,
}


# the targets that start and stop their servers, so can run several replicas and a canary
FLEET_TARGETS = ("prodrl-serve", "vllm-restart", "vllm-lora", "prodrl-serve-lora")
# the targets that load a LoRA round's adapter into running servers (``adapters``)
ADAPTER_TARGETS = ("vllm-lora", "prodrl-serve-lora")


def make_target(settings, cluster=None) -> DeployTarget:
    """``cluster`` (``ClusterSettings``): where a fleet target places its replicas with
    ``replica_placement: ray`` (None: the cluster of ``PRODRL_SETTINGS_JSON``)."""
    name = settings.deploy.target
    if name not in TARGETS:
        raise DeployError(f"unknown deploy target {name!r}; choose one of {sorted(TARGETS)}")
    if cluster is not None and name in FLEET_TARGETS:
        return TARGETS[name](settings, settings.home_path, cluster=cluster)
    return TARGETS[name](settings, settings.home_path)


__all__ = ["ADAPTER_TARGETS", "FLEET_TARGETS", "TARGETS", "DeployError", "DeployTarget", "Endpoint", "EndpointFile", "Switch", "endpoint_file", "make_target"]
