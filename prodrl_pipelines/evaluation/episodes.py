"""Play a suite's multi-turn episodes through an engine, batched turn by turn.

Every model call is rendered as a chat server would render it: the model's chat template applied to
the conversation so far (with the suite's tool schemas) and ``add_generation_prompt=True``, then
tokenized. The assistant message fed back into the next turn is what the chat server returns for
the decoded output without its stop token: the suite's ``reply_parser`` (``engines.reply_parsers``;
``none``: the text as content, ``qwen3``: reasoning and tool calls split out, as vLLM's parsers
do). Stop tokens come from the model (its tokenizer's eos token and ``generation_config.json``),
never from a literal.

A reward function that raises scores that episode as failed (reward 0) and records the error, so
one bad grader call cannot crash a round; the caller counts them.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from prodrl_pipelines.engines.reply_parsers import get_reply_parser
from prodrl_pipelines.engines.types import CallRecord, Engine, SamplingParams
from prodrl_pipelines.evaluation.suite import reply_parser


@dataclass
class PlayedCall:
    prompt_text: str
    prompt_token_ids: list[int]
    record: CallRecord
    content: str  # the assistant message fed back (decoded, stop token removed)
    created_at: datetime


@dataclass
class PlayedEpisode:
    trajectory_id: str
    task_id: str
    calls: list[PlayedCall]
    reward: float
    reward_error: str | None = None
    assistant_texts: list[str] = field(default_factory=list)


def stop_token_ids(tokenizer, model_dir: str | Path | None = None) -> tuple[int, ...]:
    """The model's own stop tokens: the tokenizer's eos token and ``generation_config.json``'s
    ``eos_token_id`` (an id or a list), as vLLM and transformers use them."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    if model_dir is not None:
        p = Path(model_dir) / "generation_config.json"
        if p.exists():
            gen = json.loads(p.read_text()).get("eos_token_id")
            if isinstance(gen, int):
                ids.add(gen)
            elif isinstance(gen, list):
                ids.update(int(t) for t in gen)
    if not ids:
        raise ValueError(f"the model{'' if model_dir is None else ' at ' + str(model_dir)} names no stop token: "
                         "set eos_token in its tokenizer or eos_token_id in generation_config.json")
    return tuple(sorted(ids))


def with_stop_tokens(params: SamplingParams, stops: tuple[int, ...]) -> SamplingParams:
    merged = tuple(sorted(set(params.stop_token_ids) | set(stops)))
    return params if merged == tuple(params.stop_token_ids) else replace(params, stop_token_ids=merged)


def render_prompt(tokenizer, messages: list[dict], tools=None) -> tuple[str, list[int]]:
    """The prompt text and ids a chat server would feed the engine for ``messages`` (and ``tools``)."""
    kw = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def assistant_content(tokenizer, output_ids: list[int], stops) -> str:
    ids = list(output_ids)
    if ids and ids[-1] in set(stops):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def turn_seed(seed: int, turn: int) -> int:
    return (int(seed) * 1_000_003 + 7919 * turn) % (2**31 - 1)


def trajectory_ids(policy_version: str, seed: int, n: int) -> list[str]:
    """uuid4 hex ids from an RNG seeded by ``(policy_version, seed)``: reruns give the same ids."""
    rng = random.Random(f"episodes:{policy_version}:{seed}")
    return [uuid.UUID(int=rng.getrandbits(128), version=4).hex for _ in range(n)]


def play_episodes(engine: Engine, tokenizer, suite, tasks: list, params: SamplingParams, policy_version: str,
                  seed: int, stops: tuple[int, ...] | None = None, ids: list[str] | None = None) -> list[PlayedEpisode]:
    """One episode per task of ``suite``, all batched through ``engine`` turn by turn (seed of turn t:
    ``turn_seed(seed, t)``). ``stops`` default to the tokenizer's eos token. ``ids``: the episodes'
    trajectory ids (default ``trajectory_ids(policy_version, seed, len(tasks))``; a batch of a larger
    evaluation passes its slice of the evaluation's ids)."""
    params = with_stop_tokens(params, stops if stops is not None else stop_token_ids(tokenizer))
    traj_ids = trajectory_ids(policy_version, seed, len(tasks)) if ids is None else list(ids)
    if len(traj_ids) != len(tasks):
        raise ValueError(f"{len(traj_ids)} trajectory ids for {len(tasks)} tasks")
    tools = getattr(suite, "tools", None)
    parse_reply = get_reply_parser(reply_parser(suite))
    messages = [suite.initial_messages(t) for t in tasks]
    calls: list[list[PlayedCall]] = [[] for _ in tasks]
    active = list(range(len(tasks)))
    turn = 0
    while active:
        rendered = [render_prompt(tokenizer, messages[i], tools) for i in active]
        records = engine.generate([ids for _, ids in rendered], params, seed=turn_seed(seed, turn))
        if len(records) != len(active):
            raise RuntimeError(f"engine returned {len(records)} records for {len(active)} prompts")
        now = datetime.now(timezone.utc)
        still: list[int] = []
        for i, (ptext, pids), rec in zip(active, rendered, records):
            content = assistant_content(tokenizer, rec.output_token_ids, params.stop_token_ids)
            calls[i].append(PlayedCall(ptext, list(pids), rec, content, now))
            messages[i].append(parse_reply(content))
            reply = suite.env_reply(tasks[i], turn, content)
            if reply is not None:  # one message (a user turn, a tool result) or a list of them
                messages[i].extend(reply if isinstance(reply, list) else [reply])
                still.append(i)
        active = still
        turn += 1
    out = []
    for i, t in enumerate(tasks):
        texts = [c.content for c in calls[i]]
        try:
            reward, error = float(suite.reward(t, texts)), None
        except Exception as e:  # noqa: BLE001 - a grader bug fails the task, not the round
            reward, error = 0.0, f"{type(e).__name__}: {e}"
        out.append(PlayedEpisode(traj_ids[i], str(t.task_id), calls[i], reward, error, texts))
    return out
