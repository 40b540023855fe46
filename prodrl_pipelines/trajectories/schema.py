"""The recorded-trajectory data contract (DESIGN.md section 3).

One row per model call, grouped by ``trajectory_id`` and ordered by ``call_index``. Rewards arrive
later and separately (``REWARD_SCHEMA``) and are joined by trajectory id.
"""

from __future__ import annotations

import pyarrow as pa

CALL_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("call_index", pa.int32(), nullable=False),
        # Task identity: lets the `task_group` baseline group repeated tasks; free text otherwise.
        pa.field("task_id", pa.string()),
        pa.field("policy_version", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("output_token_ids", pa.list_(pa.int32())),
        # log mu(a|h) after temperature/top-k/top-p ("processed" logprobs).
        pa.field("output_logprobs", pa.list_(pa.float32())),
        pa.field("top_token_ids", pa.list_(pa.list_(pa.int32()))),
        pa.field("top_logprobs", pa.list_(pa.list_(pa.float32()))),
        pa.field("support_complete", pa.bool_()),
        pa.field("temperature", pa.float32()),
        pa.field("top_p", pa.float32()),
        pa.field("top_k", pa.int32()),
        # Optional: one extra independent draw a' ~ mu per generated position (sampled score centering).
        pa.field("extra_token_ids", pa.list_(pa.int32())),
        # Optional, MoE: the experts the deployment chose per forwarded position and layer
        # (``trajectories.routing``: a compressed .npy blob) and the first position it covers.
        pa.field("routed_experts", pa.binary()),
        pa.field("routed_experts_start", pa.int32()),
        pa.field("prompt_text", pa.string()),
        pa.field("output_text", pa.string()),
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

REWARD_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("reward", pa.float64()),
        pa.field("source", pa.string()),
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
        # What produced the reward: null for a client's feedback; for a scorer its code or model and
        # rubric hash (``rewards.sources``). Re-scoring appends rows of a new version beside the old.
        pa.field("version", pa.string()),
    ]
)

# Quarantined rows keep every original field plus why they were rejected.
QUARANTINE_SCHEMA = CALL_SCHEMA.append(pa.field("quarantine_reason", pa.string())).append(
    pa.field("reward", pa.float64())
)

CALL_FIELDS = tuple(CALL_SCHEMA.names)

# Optional boolean column of a round's dataset: calls kept in their trajectory but not trained on.
UNTRAINED_COLUMN = "untrained"


def call_id(trajectory_id: str, call_index: int) -> str:
    """Stable identity of one model call, used for de-duplication."""
    return f"{trajectory_id}#{call_index}"
