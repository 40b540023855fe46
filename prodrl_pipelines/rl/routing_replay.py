"""Rollout routing replay (R3) for Hugging Face MoE models: the trainer uses the deployment's experts.

Engines route some tokens to other experts than the trainer would (bf16 vs fp32, quantised weights,
batch-dependent kernels), and a flipped expert moves log pi far more than a rounding error: that is
the heavy tail of train-inference mismatch on MoE models. Replay makes every MoE layer of the
trainer use, at each position, the expert set the deployment recorded; the mixing weights stay the
trainer's own router probabilities at those experts (renormalised over the set when the model
normalises its top-k), so the router keeps receiving gradients.

The hook: a forward hook on each router module, i.e. a module that returns ``(router_logits,
top_k_weights, top_k_indices)`` and has ``top_k`` and ``num_experts`` (Hugging Face Qwen3-MoE's
``Qwen3MoeTopKRouter``, the ``mlp.gate`` of each sparse block; Qwen3.5/3.6-MoE and other
architectures with the same router contract work the same way). The routing installed on the
model (``set_routing``) stays until replaced, so activation checkpointing's recomputation in
backward replays the same experts. Positions without a recording keep the trainer's own choice.
The hook also counts, per layer, how often the recorded set differs from the trainer's own top-k
(``RoutingStats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

_HOOKED = "_prodrl_routing_hooked"


def routers(model: nn.Module) -> list[nn.Module]:
    """The router modules of ``model`` in forward (layer) order; [] for a dense model."""
    return [m for m in model.modules()
            if hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and getattr(m, "weight").dim() == 2 and getattr(m, "weight").shape[0] == getattr(m, "num_experts")]


def moe_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, experts per token, experts) of ``model``; None when it has no router."""
    rs = routers(model)
    if not rs:
        return None
    return len(rs), int(rs[0].top_k), int(rs[0].num_experts)


@dataclass
class RoutingStats:
    """Per layer: replayed positions, and those whose recorded expert set differs from the trainer's."""

    positions: list[int] = field(default_factory=list)
    differ: list[int] = field(default_factory=list)

    def add(self, layer: int, positions: int, differ: int) -> None:
        while len(self.positions) <= layer:
            self.positions.append(0)
            self.differ.append(0)
        self.positions[layer] += positions
        self.differ[layer] += differ

    @property
    def disagreement(self) -> float:
        n = sum(self.positions)
        return sum(self.differ) / n if n else float("nan")

    def per_layer(self) -> list[float]:
        return [d / n if n else float("nan") for d, n in zip(self.differ, self.positions)]

    def as_metrics(self, prefix: str = "routing_") -> dict[str, float]:
        out = {f"{prefix}disagreement": self.disagreement, f"{prefix}replayed_positions": float(sum(self.positions))}
        out.update({f"{prefix}disagreement_layer_{i}": v for i, v in enumerate(self.per_layer())})
        return out


class _State:
    def __init__(self) -> None:
        self.routing: torch.Tensor | None = None  # [N*L, layers, k] long
        self.known: torch.Tensor | None = None  # [N*L] bool
        self.stats: RoutingStats | None = None
        self.capture: list[list[torch.Tensor]] | None = None  # per layer, the chosen indices per forward
        self.n_layers = 0
        self.replay = True  # False: only compare the recorded sets with the model's own (stats)


def _hook(layer: int, state: _State):
    def hook(module, args, output):
        if state.capture is not None:
            state.capture[layer].append(output[2].detach())
        if state.routing is None:
            return output
        logits, weights, own = output
        if own.shape[0] != state.routing.shape[0]:
            raise ValueError(f"routing replay: layer {layer} routed {own.shape[0]} positions, the installed "
                             f"routing covers {state.routing.shape[0]} (a routing installed for another batch?)")
        rec = state.routing[:, layer, :].to(own.device)
        known = state.known.to(own.device)
        idx = torch.where(known[:, None], rec, own)
        if state.stats is not None and bool(known.any()):
            with torch.no_grad():
                same = (torch.sort(rec[known], -1).values == torch.sort(own[known], -1).values).all(-1)
                state.stats.add(layer, int(known.sum()), int((~same).sum()))
        if not state.replay:
            return output
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w = probs.gather(-1, idx)
        if getattr(module, "norm_topk_prob", False):
            w = w / w.sum(-1, keepdim=True)
        return logits, w.to(weights.dtype), idx

    return hook


def _state(model: nn.Module) -> _State | None:
    st = getattr(model, _HOOKED, None)
    if st is not None:
        return st
    rs = routers(model)
    if not rs:
        return None
    st = _State()
    st.n_layers = len(rs)
    for i, r in enumerate(rs):
        r.register_forward_hook(_hook(i, st))
    object.__setattr__(model, _HOOKED, st)  # not a submodule or parameter: FSDP and state_dict ignore it
    return st


def set_routing(model: nn.Module, routing: torch.Tensor | None, known: torch.Tensor | None = None,
                stats: RoutingStats | None = None, replay: bool = True) -> bool:
    """Install ``routing`` [N, L, layers, k] (``known`` [N, L]: positions with a recording) for the
    model's next forwards, or remove it (None). ``replay=False`` leaves the model's own routing in
    place and only counts, into ``stats``, where the recorded sets differ from it. Returns False for
    a model without routers (dense), which ignores routing."""
    st = _state(model)
    if st is None:
        return False
    if routing is None:
        st.routing = st.known = None
        st.stats = None
        return True
    layers = st.n_layers
    if routing.dim() != 4 or routing.shape[2] != layers:
        raise ValueError(f"routing must be [rows, positions, {layers} layers, k], got {tuple(routing.shape)}")
    st.routing = routing.reshape(-1, routing.shape[2], routing.shape[3]).long()
    st.known = (torch.ones(routing.shape[:2], dtype=torch.bool) if known is None else known).reshape(-1)
    st.stats = stats
    st.replay = replay
    return True


class capture_routing:
    """``with capture_routing(model) as cap:`` records the experts every router chose in the forwards
    inside the block: ``cap.layers[l]`` lists the [positions, k] index tensors of layer l, one per
    forward (replayed positions show the replayed experts). A dense model captures nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.state = _state(model)
        self.layers: list[list[torch.Tensor]] = [[] for _ in range(self.state.n_layers)] if self.state else []

    def __enter__(self) -> "capture_routing":
        if self.state is not None:
            self.state.capture = self.layers
        return self

    def __exit__(self, *exc) -> None:
        if self.state is not None:
            self.state.capture = None

    def forward_routing(self, i: int) -> torch.Tensor:
        """Forward ``i``'s choices as [positions, layers, k]."""
        return torch.stack([layer[i] for layer in self.layers], dim=1)


def own_routing(model: nn.Module, input_ids: torch.Tensor, **kw) -> np.ndarray | None:
    """The experts ``model`` itself chooses for every position of ``input_ids`` [N, L]: [N, L, layers, k]."""
    st = _state(model)
    if st is None:
        return None
    saved = st.routing, st.known, st.stats
    st.routing = st.known = st.stats = None
    st.capture = [[] for _ in range(st.n_layers)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False, **kw)
        out = torch.stack([torch.cat(c) for c in st.capture], dim=1)
    finally:
        st.capture = None
        st.routing, st.known, st.stats = saved
    return out.reshape(*input_ids.shape, *out.shape[1:]).cpu().numpy()
