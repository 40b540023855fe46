"""Run multi-turn lab episodes through an engine, batched turn by turn.

Any lab task (``tasks.TaskEnv``: arithmetic by default, chess) plays through the same loop.

Every model call is rendered exactly as a chat server would: the chat template applied to the
conversation so far with ``add_generation_prompt=True``, then tokenized. The assistant message fed
back into the next turn is the decoded output without the stop token. Each call becomes one row of
the recorded-trajectory contract (``CALL_SCHEMA``); each episode gets a verifiable reward.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Protocol

import pyarrow as pa

from prodrl_pipelines.engines.types import CallRecord, SamplingParams
from prodrl_pipelines.lab.tasks import ARITHMETIC, TaskEnv
from prodrl_pipelines.lab.tokenizer import IM_END
from prodrl_pipelines.trajectories.schema import CALL_FIELDS, CALL_SCHEMA, REWARD_SCHEMA

_HAS_EXTRA = "extra_token_ids" in CALL_FIELDS  # optional extra draw a' ~ mu (sampled score centering)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[CallRecord]: ...


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
    """The prompt text and ids a chat server would feed the engine for ``messages`` (and ``tools``:
    a tool-aware chat template such as Qwen's renders their schema and call format; the lab
    template ignores them)."""
    kw = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text, list(ids)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    return (int(tokenizer.convert_tokens_to_ids(IM_END)),)


def with_stop_tokens(params: SamplingParams, tokenizer) -> SamplingParams:
    """``params`` with ``<|im_end|>`` among its stop tokens."""
    stops = tuple(sorted(set(params.stop_token_ids) | set(stop_token_ids(tokenizer))))
    if stops == tuple(params.stop_token_ids):
        return params
    return replace(params, stop_token_ids=stops)


def assistant_content(tokenizer, output_ids: list[int]) -> str:
    """The assistant message content: the decoded output without the trailing stop token."""
    ids = list(output_ids)
    stops = set(stop_token_ids(tokenizer))
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def _extra_ids(rec: CallRecord) -> list[int] | None:
    extra = getattr(rec, "extra_token_ids", None)
    return None if extra is None else [int(t) for t in extra]


def _turn_seed(seed: int, turn: int) -> int:
    return (int(seed) * 1_000_003 + 7919 * turn) % (2**31 - 1)


def run_episodes(
    engine: Engine,
    tokenizer,
    tasks: list,
    params: SamplingParams,
    policy_version: str,
    seed: int,
    env: TaskEnv = ARITHMETIC,
) -> EpisodeBatch:
    """Play one episode per task of ``env``, all episodes batched through ``engine`` turn by turn.

    ``<|im_end|>`` is always a stop token. Trajectory ids are uuid4 hex strings drawn from an RNG
    seeded by ``(policy_version, seed)``, so reruns produce the same ids.
    """
    params = with_stop_tokens(params, tokenizer)
    rng = random.Random(f"episodes:{policy_version}:{seed}")
    traj_ids = [uuid.UUID(int=rng.getrandbits(128), version=4).hex for _ in tasks]
    messages = [env.initial_messages(t) for t in tasks]
    texts: list[list[str]] = [[] for _ in tasks]
    calls: list[list[dict]] = [[] for _ in tasks]
    active = list(range(len(tasks)))
    turn = 0
    while active:
        rendered = [render_prompt(tokenizer, messages[i], env.tools) for i in active]
        records = engine.generate([ids for _, ids in rendered], params, seed=_turn_seed(seed, turn))
        if len(records) != len(active):
            raise RuntimeError(f"engine returned {len(records)} records for {len(active)} prompts")
        now = datetime.now(timezone.utc)
        still: list[int] = []
        for i, (ptext, pids), rec in zip(active, rendered, records):
            content = assistant_content(tokenizer, rec.output_token_ids)
            calls[i].append(
                {
                    "trajectory_id": traj_ids[i],
                    "call_index": turn,
                    "task_id": tasks[i].task_id,
                    "policy_version": policy_version,
                    "prompt_token_ids": list(pids),
                    "output_token_ids": [int(t) for t in rec.output_token_ids],
                    "output_logprobs": [float(x) for x in rec.output_logprobs],
                    "top_token_ids": [[int(t) for t in row] for row in rec.top_token_ids],
                    "top_logprobs": [[float(x) for x in row] for row in rec.top_logprobs],
                    "support_complete": bool(rec.support_complete),
                    "temperature": float(params.temperature),
                    "top_p": float(params.top_p),
                    "top_k": int(params.top_k),
                    "prompt_text": ptext,
                    "output_text": content,
                    "created_at": now,
                }
            )
            if _HAS_EXTRA:
                calls[i][-1]["extra_token_ids"] = _extra_ids(rec)
            texts[i].append(content)
            messages[i].append({"role": "assistant", "content": content})
            reply = env.env_reply(tasks[i], turn, content)
            if reply is not None:
                messages[i].append(reply)
                still.append(i)
        active = still
        turn += 1
    episodes = [
        Episode(
            trajectory_id=traj_ids[i],
            task_id=t.task_id,
            reward=env.reward(t, texts[i]),
            calls=calls[i],
            assistant_texts=texts[i],
        )
        for i, t in enumerate(tasks)
    ]
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
