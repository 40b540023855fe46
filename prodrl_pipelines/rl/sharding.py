"""FSDP2 for the torchrun path: parameters, gradients and Adam state sharded over the ranks.

``shard_policy`` wraps the policy in ``PolicyLogprobs`` (so the trainer's whole log-prob computation
is one module's forward, and FSDP2's root hooks gather and reduce the root's parameters: embeddings,
final norm, lm_head), shards every decoder layer and then that root with ``fully_shard`` over a
1-D device mesh (CPU with gloo, or CUDA with nccl). Mixed precision on GPU: bf16 parameters in
forward/backward, fp32 reduction and fp32 master weights; fp32 throughout on CPU. MoE experts are
parameters of their layer and are sharded with it. Gradients are summed over the ranks, not
averaged: each rank's objective is its share of the minibatch's sequences with the minibatch's
token weights 1/(B*T_i) (``trainer.layout_round``), so the sum is the full gradient, exactly as the
single-process step.

State moves between sharded and whole (``full_model_state``, ``full_optimizer_state``,
``load_full_optimizer_state``): the round's checkpoint is written whole by rank 0 (Hugging Face
safetensors + the optimizer state keyed by parameter index, as a single process writes it), so the
next round loads it at any world size. In-round resume checkpoints stay sharded
(``save_sharded_state``: ``torch.distributed.checkpoint``, each rank writing its part, plus each
rank's RNG and step counters); they resume on the same world size.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch
from torch import nn

__all__ = ["shard_policy", "checkpoint_activations", "full_model_state", "full_optimizer_state", "load_full_optimizer_state", "decoder_layers",
           "save_sharded_state", "load_sharded_state", "remove_sharded_state"]


def decoder_layers(policy: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``policy.model.layers``; through a LoRA
    policy's PEFT wrapper to the causal LM it adapts)."""
    from prodrl_pipelines.rl.lora import causal_lm

    policy = causal_lm(policy)
    layers = getattr(getattr(policy, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(policy).__name__} has no model.layers to shard")
    return list(layers)


def checkpoint_activations(policy: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them (torch's
    composable ``checkpoint``: hooks, parameter names unchanged; apply before ``shard_policy``)."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(policy):
        checkpoint(layer)


def shard_policy(policy: nn.Module, world_size: int):
    """The policy as a ``PolicyLogprobs`` module sharded over ``world_size`` ranks (call after
    ``init_process_group``). Build the optimizer from the returned module's parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from prodrl_pipelines.rl.logprobs import PolicyLogprobs

    cuda = torch.cuda.is_available()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
    root = PolicyLogprobs(policy)
    units = decoder_layers(policy)
    for layer in units:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    for m in [*units, root]:
        m.set_gradient_divide_factor(1.0)  # a sum over the ranks' partial objectives
        m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return root


def _param_names(module: nn.Module) -> list[str]:
    """The parameters an optimizer over ``module``'s trained parameters indexes, in its order (a LoRA
    policy's adapters; every parameter of a full one), as a single process's optimizer does."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def full_model_state(root) -> dict[str, torch.Tensor]:
    """The policy's whole state dict on CPU (a collective: every rank calls it; rank 0 gets it, the
    others an empty dict), keyed as the unwrapped Hugging Face model's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("policy."): v for k, v in sd.items()}


def full_optimizer_state(root, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state keyed by parameter index (``torch.optim`` layout, what a single
    process saves and loads); a collective, the state on rank 0, an empty dict elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(root, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not osd:  # with cpu_offload the whole state lands on rank 0 only
        return {}
    index = {n: i for i, n in enumerate(_param_names(root))}
    state = {index[name]: v for name, v in osd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(root, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a whole, index-keyed optimizer state (any world size saved it) into the sharded optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _param_names(root)
    osd = {"state": {names[i]: v for i, v in state["state"].items()},
           "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
                            for g in state["param_groups"]]}
    set_optimizer_state_dict(root, optimizer, osd, options=StateDictOptions(full_state_dict=True))


def save_sharded_state(path: Path, root, optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """The sharded model and optimizer, this rank's part at ``path`` (a directory of this rank's own:
    the ranks may share no disk), atomically: the rank writes its part and its ``meta`` (RNG,
    counters) into a temporary directory and renames it once written; rank 0's part holds the
    checkpoint's ``.metadata``. A collective; every rank's part is in place when it returns."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    msd, osd = get_state_dict(root, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp))
    torch.save({**meta, "world_size": dist.get_world_size()}, tmp / f"meta-rank{rank}.pt")
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def remove_sharded_state(path: Path) -> None:
    """Remove this rank's ``save_sharded_state`` directory once every rank is past its last read of
    the state (and the state's directory, once it is empty)."""
    import torch.distributed as dist

    dist.barrier()
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty yet (another rank's part on a shared disk), or gone
        path.parent.rmdir()


def load_sharded_state(path: Path, root, optimizer: torch.optim.Optimizer, fingerprint: str) -> dict | None:
    """Load a whole ``save_sharded_state`` checkpoint (every rank's part, in ``path``) into the sharded
    model and optimizer and return this rank's meta; None (nothing loaded) when any rank has none, or
    one of another plan or another world size."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta_file = Path(path) / f"meta-rank{dist.get_rank()}.pt"
    meta = torch.load(meta_file, map_location="cpu", weights_only=False) if meta_file.exists() else None
    ok = torch.tensor([int(meta is not None and meta["fingerprint"] == fingerprint
                           and meta["world_size"] == dist.get_world_size())])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank resumes, or none does
    if not ok.item():
        return None
    msd, osd = get_state_dict(root, optimizer)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(root, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    return meta
