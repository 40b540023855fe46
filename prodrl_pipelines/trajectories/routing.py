"""Recorded MoE routing: the experts the deployment chose for every position of a call.

A call's routing is an integer array ``[positions, moe_layers, experts_per_token]``: position p is
the p-th token the engine forwarded (prompt then output; the last sampled token is never forwarded,
so a call covers ``len(prompt) + len(output) - 1 - start`` positions from ``start``, vLLM's
``routed_experts`` layout with ``routed_experts_prompt_start``). Stored per call as one compact blob:
a ``.npy`` of the smallest unsigned type that holds the expert ids, zlib-compressed (a 35B-A3B
call of 4k positions x 48 layers x 8 experts is 1.5 MB raw, a few hundred KB stored), with the
first covered position in ``routed_experts_start``. A call without routing (dense model, flag off,
aborted) has both null and stays valid.
"""

from __future__ import annotations

import base64
import io
import zlib

import numpy as np

ROUTING_COLUMN = "routed_experts"
ROUTING_START_COLUMN = "routed_experts_start"
_MAGIC = b"\x93NUMPY"


class RoutingError(ValueError):
    """Routing data that cannot be decoded or does not fit its call; the message says how."""


def smallest_dtype(max_id: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if max_id <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise RoutingError(f"expert id {max_id} does not fit 32 bits")


def _as_routing(arr) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim != 3:
        raise RoutingError(f"routing must be [positions, layers, experts_per_token], got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise RoutingError(f"routing must hold integer expert ids, got dtype {a.dtype}")
    if a.size and int(a.min()) < 0:
        raise RoutingError(f"routing holds a negative expert id ({int(a.min())})")
    return a


def encode_routing(arr) -> bytes:
    """``arr`` [positions, layers, k] as the stored blob (smallest unsigned dtype, .npy, zlib)."""
    a = _as_routing(arr)
    a = a.astype(smallest_dtype(int(a.max()) if a.size else 0), copy=False)
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return zlib.compress(buf.getvalue(), 1)


def decode_routing(blob: bytes) -> np.ndarray:
    """The stored blob back as [positions, layers, k]; ``RoutingError`` when it is not one."""
    try:
        raw = zlib.decompress(blob)
    except (zlib.error, TypeError) as exc:
        raise RoutingError(f"routing blob is not zlib data ({exc})") from None
    return _load_npy(raw)


def _load_npy(raw: bytes) -> np.ndarray:
    if not raw.startswith(_MAGIC):
        raise RoutingError("routing is not a .npy array")
    try:
        return _as_routing(np.load(io.BytesIO(raw), allow_pickle=False))
    except RoutingError:
        raise
    except Exception as exc:  # a truncated or corrupt header
        raise RoutingError(f"routing .npy cannot be read ({exc})") from None


def from_vllm(value: str) -> np.ndarray:
    """vLLM's ``routed_experts`` (base64 of a .npy, ``--enable-return-routed-experts``) as an array."""
    try:
        raw = base64.b64decode(value, validate=True)
    except Exception as exc:
        raise RoutingError(f"routed_experts is not base64 ({exc})") from None
    return _load_npy(raw)


def to_vllm(arr) -> str:
    """``arr`` as vLLM's ``routed_experts`` (base64 of a .npy, the array's own dtype)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(_as_routing(arr)), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def covered_positions(n_prompt: int, n_output: int, start: int = 0) -> int:
    """Positions a call's routing covers: every forwarded token from ``start``."""
    return max(0, n_prompt + n_output - 1 - start)


def check_fits(arr: np.ndarray, n_prompt: int, n_output: int, start: int,
               layers: int | None = None, k: int | None = None, num_experts: int | None = None) -> str | None:
    """None when ``arr`` is the routing of such a call (and of such a model, where given), else why not."""
    if start < 0 or start > n_prompt:
        return f"start {start} outside the prompt [0, {n_prompt}]"
    want = covered_positions(n_prompt, n_output, start)
    if arr.shape[0] != want:
        return f"{arr.shape[0]} positions for a call of {n_prompt} prompt + {n_output} output ids from {start} ({want})"
    if layers is not None and arr.shape[1] != layers:
        return f"{arr.shape[1]} layers, the model has {layers} MoE layers"
    if k is not None and arr.shape[2] != k:
        return f"{arr.shape[2]} experts per token, the model routes to {k}"
    if num_experts is not None and arr.size and int(arr.max()) >= num_experts:
        return f"expert id {int(arr.max())} outside [0, {num_experts})"
    if arr.size and arr.shape[2] > 1 and (np.diff(np.sort(arr, axis=-1), axis=-1) == 0).any():
        return "an expert repeated within one position's set"
    return None
