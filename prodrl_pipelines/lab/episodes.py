"""Lab episodes as recorded traffic: the production episode loop (``evaluation.episodes``) on a
lab task, each call turned into one row of the recorded-trajectory contract (``CALL_SCHEMA``).

Any lab task (``tasks.TaskEnv``: arithmetic by default, chess) is an evaluation suite too, so it
plays through the same loop as a user's suite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

import pyarrow as pa

from prodrl_pipelines.engines.types import CallRecord, Engine, SamplingParams
from prodrl_pipelines.evaluation import episodes as _core
from prodrl_pipelines.lab.tasks import ARITHMETIC, TaskEnv
from prodrl_pipelines.lab.tokenizer import IM_END
from prodrl_pipelines.trajectories.routing import ROUTING_COLUMN, ROUTING_START_COLUMN, encode_routing
from prodrl_pipelines.trajectories.schema import CALL_FIELDS, CALL_SCHEMA, REWARD_SCHEMA

_HAS_EXTRA = "extra_token_ids" in CALL_FIELDS  # optional extra draw a' ~ mu (sampled score centering)


@dataclass
class Episode:
    trajectory_id: str
    task_id: str
    reward: float
    calls: list[dict]  # CALL_SCHEMA rows, ordered by call_index
    assistant_texts: list[str] = field(default_factory=list)


@dataclass
class EpisodeBatch:
    episodes: list[Episode]
    policy_version: str
    source: str = ARITHMETIC.reward_source  # the reward source of the task that produced them

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def mean_reward(self) -> float:
        return sum(e.reward for e in self.episodes) / max(len(self.episodes), 1)

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]

    def call_rows(self) -> list[dict]:
        return [row for e in self.episodes for row in e.calls]

    def reward_rows(self, source: str | None = None) -> list[dict]:
        source = source or self.source
        now = datetime.now(timezone.utc)
        return [
            {"trajectory_id": e.trajectory_id, "reward": float(e.reward), "source": source, "created_at": now}
            for e in self.episodes
        ]

    def calls_table(self) -> pa.Table:
        return pa.Table.from_pylist(self.call_rows(), schema=CALL_SCHEMA)

    def rewards_table(self, source: str | None = None) -> pa.Table:
        return pa.Table.from_pylist(self.reward_rows(source), schema=REWARD_SCHEMA)


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """The prompt text and ids a chat server would feed the engine (``evaluation.episodes``)."""
    return _core.render_prompt(tokenizer, messages, tools)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    return (int(tokenizer.convert_tokens_to_ids(IM_END)),)


def assistant_content(tokenizer, output_ids: list[int]) -> str:
    """The assistant message content: the decoded output without the trailing stop token."""
    return _core.assistant_content(tokenizer, output_ids, stop_token_ids(tokenizer))


def routing_fields(rec: CallRecord) -> dict:
    """The call's recorded MoE routing as the two stored columns (null for a dense model or when off)."""
    routing = getattr(rec, "routed_experts", None)
    if routing is None:
        return {ROUTING_COLUMN: None, ROUTING_START_COLUMN: None}
    return {ROUTING_COLUMN: encode_routing(routing), ROUTING_START_COLUMN: int(rec.routed_experts_start)}


def _extra_ids(rec: CallRecord) -> list[int] | None:
    extra = getattr(rec, "extra_token_ids", None)
    return None if extra is None else [int(t) for t in extra]


def run_episodes(
    engine: Engine,
    tokenizer,
    tasks: list,
    params: SamplingParams,
    policy_version: str,
    seed: int,
    env: TaskEnv = ARITHMETIC,
) -> EpisodeBatch:
    """Play one episode per task of ``env`` (``evaluation.episodes.play_episodes``) and turn each call
    into a row of the recorded-trajectory contract.

    ``<|im_end|>`` is always a stop token. Trajectory ids are uuid4 hex strings drawn from an RNG
    seeded by ``(policy_version, seed)``, so reruns produce the same ids.
    """
    played = _core.play_episodes(engine, tokenizer, env, tasks, params, policy_version, seed,
                                 stops=stop_token_ids(tokenizer))
    episodes = []
    for ep in played:
        if ep.reward_error:
            raise RuntimeError(f"lab task {env.name!r}: reward of {ep.task_id} failed: {ep.reward_error}")
        rows = []
        for turn, c in enumerate(ep.calls):
            rec = c.record
            rows.append({
                "trajectory_id": ep.trajectory_id,
                "call_index": turn,
                "task_id": ep.task_id,
                "policy_version": policy_version,
                "prompt_token_ids": list(c.prompt_token_ids),
                "output_token_ids": [int(t) for t in rec.output_token_ids],
                "output_logprobs": [float(x) for x in rec.output_logprobs],
                "top_token_ids": [[int(t) for t in row] for row in rec.top_token_ids],
                "top_logprobs": [[float(x) for x in row] for row in rec.top_logprobs],
                "support_complete": bool(rec.support_complete),
                "temperature": float(params.temperature),
                "top_p": float(params.top_p),
                "top_k": int(params.top_k),
                "prompt_text": c.prompt_text,
                "output_text": c.content,
                "created_at": c.created_at,
            })
            if _HAS_EXTRA:
                rows[-1]["extra_token_ids"] = _extra_ids(rec)
            rows[-1].update(routing_fields(rec))
        episodes.append(Episode(trajectory_id=ep.trajectory_id, task_id=ep.task_id, reward=ep.reward, calls=rows,
                                assistant_texts=ep.assistant_texts))
    return EpisodeBatch(episodes=episodes, policy_version=policy_version, source=env.reward_source)


def heldout_reward(
    engine: Engine,
    tokenizer,
    tasks: list,
    params: SamplingParams,
    seed: int = 0,
    env: TaskEnv = ARITHMETIC,
) -> float:
    """Mean reward over ``tasks`` (convenience for evaluation)."""
    return run_episodes(engine, tokenizer, tasks, params, policy_version="eval", seed=seed, env=env).mean_reward
