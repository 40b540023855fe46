"""The arithmetic task in production text: short reasoning, answers through a tool (DESIGN.md s.9).

The same tasks, held-out split and per-turn judging as ``arithmetic``; what changes is the text. The
model thinks briefly and submits each running value with the ``answer`` tool; the harness keeps the
server's parsed message (``engines.reply_parsers.parse_qwen3``) and the Qwen3-style template of
``production_text`` renders it on the next call::

    user:      12+7
    assistant: <think>\\n12+7\\n</think>\\n\\n<tool_call>\\n{"name": "answer", "arguments": {"value": 19}}\\n</tool_call>
    tool:      ok
    user:      then -3
    assistant: <think>\\n19-3\\n</think>\\n\\n<tool_call>\\n...{"value": 16}}\\n</tool_call>

So a multi-turn episode exercises what makes production text hard to rebuild: earlier reasoning is
dropped from the history, a call written compactly (``{"name":"answer",...}``) comes back
re-serialised by the server and the template, and the byte-level BPE merges a number with or
without its leading space into different tokens.

The verifier takes the value of an ``answer`` call (compact or spaced JSON alike); an answer written
as plain text is wrong for that turn. The sloppy demonstrator of the warm start does that with
probability ``format_noise`` (the habit RL removes, as ``=12`` in the plain task) and writes the
call compactly with probability ``compact_noise`` (harmless to the reward, not to a retokenizer).

**Agent loop** (the demonstration option ``agent_loop``: ``build_base_policy(..., task="arithmetic_tools",
sft={"agent_loop": True})``, ``with_demo_options``): demonstrations of the loop an agent SDK runs with
one function tool ``add(a, b)``; each user turn is a call, the tool's result and a text answer::

    system:    <tools>\nadd(a, b)\n</tools>              (the template renders the tools compactly)
    user:      12+7
    assistant: <think>\n12+7\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}\n</tool_call>
    tool:      19
    assistant: <think>\n\n</think>\n\n19
    user:      then -3
    assistant: <think>\n19-3\n</think>\n\n<tool_call>\n...{"a": 19, "b": -3}}\n</tool_call>
    ...

rendered through ``production_text.QWEN3_STYLE_TOOLS_TEMPLATE`` (the policy's own template, what
``prodrl serve`` renders), each call trained on the history a client keeps: a third of the
demonstrations echo the call's reasoning back (pydantic-ai does), a third do not (langchain), a third
see their earlier calls as sampled, reasoning included (a recorder in ``chat_history: extend`` mode;
without these, the policy answered the second question in text, never calling the tool, once it saw
its own earlier reasoning). A policy built so is one to serve agents against (tests/conftest.py's
``tools_policy_dir``, tests/test_agent_sdks.py); the lab's episodes and verifier of this task stay
the ``answer`` tool's (``env_reply``, ``reward``), which such a policy does not play.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

from prodrl_pipelines.engines.reply_parsers import parse_qwen3
from prodrl_pipelines.lab import arithmetic
from prodrl_pipelines.lab.arithmetic import ArithmeticTask, apply_op

TOOL_NAME = "answer"
ANSWER_TOOL = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "Submit the running value.",
    "parameters": {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]}}}
TOOL_RESULT = "ok"
EMPTY_THINK = "<think>\n\n</think>\n\n"
COMPACT_NOISE = 0.3  # the demo demonstrator's share of compactly written calls
MIN_MAX_TOKENS = 40  # the longest reference reply is ~26 tokens with <|im_end|> (measured); margin for split numbers
# the agent loop's tool (the demonstrations' definition; an SDK's own ``add(a, b)`` renders the same line)
ADD_NAME = "add"
ADD_TOOL = {"type": "function", "function": {
    "name": ADD_NAME, "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
# how the client of an agent-loop demonstration keeps its history (one drawn per demonstration): the
# call's reasoning echoed back (pydantic-ai), not echoed (langchain), or the recorder extending the
# previous call's tokens (chat_history: extend; earlier reasoning stays in view)
CLIENT_HISTORIES = ("echo", "no_echo", "extend")


def env_reply(task: ArithmeticTask, turn: int, assistant_text: str) -> list[dict] | None:
    """After turn ``turn``: the tool's result (when the model called it) and the next operation."""
    if turn + 1 >= task.n_turns:
        return None
    out = [{"role": "tool", "content": TOOL_RESULT}] if parse_qwen3(assistant_text).get("tool_calls") else []
    return out + [{"role": "user", "content": task.prompt(turn + 1)}]


def parse_answer(text: str) -> int | None:
    """The integer ``value`` of the reply's single ``answer`` call, else None."""
    calls = parse_qwen3(text).get("tool_calls") or []
    if len(calls) != 1 or calls[0]["function"]["name"] != TOOL_NAME:
        return None
    args = json.loads(calls[0]["function"]["arguments"])  # any JSON value, as vLLM's parser takes it
    value = args.get("value") if isinstance(args, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reward(task: ArithmeticTask, assistant_texts: list[str]) -> float:
    """Fraction of turns answered correctly, each judged as in ``arithmetic`` (against the model's
    own previous answer), the answer read from the tool call."""
    return arithmetic.reward(task, assistant_texts, parse=parse_answer)


def reply_text(prev: int, op: str, x: int, value: int, *, compact: bool = False, plain: bool = False) -> str:
    """A demonstrated reply: the reasoning, then the call (spaced as the template writes it, or compact)."""
    think = f"<think>\n{prev}{op}{x}\n</think>\n\n"
    if plain:
        return think + str(value)
    sep = (",", ":") if compact else (", ", ": ")
    call = json.dumps({"name": TOOL_NAME, "arguments": {"value": value}}, separators=sep)
    return think + f"<tool_call>\n{call}\n</tool_call>"


def noisy_messages(task: ArithmeticTask, rng: random.Random, answer_noise: float = 0.0, format_noise: float = 0.0,
                   compact_noise: float = 0.0) -> list[dict]:
    """A transcript (assistant messages as raw sampled text) from a sloppy demonstrator."""
    msgs: list[dict] = []
    prev = task.numbers[0]
    for turn in range(task.n_turns):
        op, x = task.ops[turn], task.numbers[turn + 1]
        value = apply_op(prev, op, x)
        if answer_noise > 0 and rng.random() < answer_noise:
            value += rng.choice((-2, -1, 1, 2))
        plain = format_noise > 0 and rng.random() < format_noise
        compact = compact_noise > 0 and rng.random() < compact_noise
        text = reply_text(prev, op, x, value, compact=compact, plain=plain)
        msgs.append({"role": "user", "content": task.prompt(turn)})
        msgs.append({"role": "assistant", "content": text})
        if not plain and turn + 1 < task.n_turns:
            msgs.append({"role": "tool", "content": TOOL_RESULT})
        prev = value
    return msgs


def reference_messages(task: ArithmeticTask) -> list[dict]:
    return noisy_messages(task, random.Random(0))


def corpus_text(n: int = 2000, seed: int = 0) -> list[str]:
    """Task text for the tokenizer: transcripts rendered both ways (spaced and compact calls)."""
    rng = random.Random(f"arithmetic_tools-corpus:{seed}")
    texts: list[str] = []
    tasks = arithmetic.generate_tasks(n, seed) + arithmetic.heldout_tasks(n // 10)
    for t in tasks:
        for m in noisy_messages(t, rng, format_noise=0.1, compact_noise=0.5):
            texts.append(m["content"])
    return texts


def build_tokenizer():
    """The byte-level BPE of ``production_text`` trained on this task's text and the generic corpus."""
    from prodrl_pipelines.lab.production_text import build_byte_bpe_tokenizer, production_corpus

    markup = ["user\n", "assistant\n", "\n\n", "tool"] * 500  # the template's role headers merge too
    return build_byte_bpe_tokenizer(vocab_size=512, corpus=markup + corpus_text() + production_corpus(n=500))


# ----------------------------------------------------------------------------- the agent loop


def agent_call_text(prev: int, op: str, x: int, *, compact: bool = False) -> str:
    """The demonstrated first reply of a turn: the reasoning, then ``add(prev, +-x)``."""
    sep = (",", ":") if compact else (", ", ": ")
    call = json.dumps({"name": ADD_NAME, "arguments": {"a": prev, "b": x if op == "+" else -x}}, separators=sep)
    return f"<think>\n{prev}{op}{x}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"


def agent_loop_messages(task: ArithmeticTask, rng: random.Random, answer_noise: float = 0.0,
                        format_noise: float = 0.0, compact_noise: float = 0.0) -> list[dict]:
    """A transcript of the agent loop (module docstring): per turn the user's operation, the ``add``
    call, the tool's result and the answer as text. ``format_noise``: the share of turns answered
    without the tool; ``answer_noise``: of text answers off by 1-2 from the tool's result;
    ``compact_noise``: of calls written compactly. The client's history (``CLIENT_HISTORIES``) is
    drawn per transcript and marked on its assistant messages for ``warmstart._CallEncoder``."""
    msgs: list[dict] = []
    prev = task.numbers[0]
    client = rng.choice(CLIENT_HISTORIES)
    mark = {"echo": {}, "no_echo": {"echo_reasoning": False}, "extend": {"extends": True}}[client]
    for turn in range(task.n_turns):
        op, x = task.ops[turn], task.numbers[turn + 1]
        result = apply_op(prev, op, x)
        value = result
        if answer_noise > 0 and rng.random() < answer_noise:
            value += rng.choice((-2, -1, 1, 2))
        msgs.append({"role": "user", "content": task.prompt(turn)})
        if format_noise > 0 and rng.random() < format_noise:
            msgs.append({"role": "assistant", "content": reply_text(prev, op, x, value, plain=True), **mark})
        else:
            compact = compact_noise > 0 and rng.random() < compact_noise
            msgs.append({"role": "assistant", "content": agent_call_text(prev, op, x, compact=compact), **mark})
            msgs.append({"role": "tool", "content": str(result)})
            # an empty think block, as Qwen3 answers: a reply without one is all reasoning to vLLM's qwen3 parser
            msgs.append({"role": "assistant", "content": EMPTY_THINK + str(value), **mark})
        prev = value
    return msgs


def build_agent_tokenizer():
    """The task's tokenizer (same ids) as a served agent policy needs it: the template renders the
    tool definitions, and the markup tokens are not special, so ``prodrl serve``'s reply parser sees
    ``<think>`` and ``<tool_call>`` in the reply (``production_text.markup_as_text``)."""
    from prodrl_pipelines.lab.production_text import QWEN3_STYLE_TOOLS_TEMPLATE, markup_as_text

    tok = markup_as_text(build_tokenizer())
    tok.chat_template = QWEN3_STYLE_TOOLS_TEMPLATE
    return tok


def with_demo_options(env, agent_loop: bool = False):
    """The task as its demonstration options show it (``tasks.TaskEnv.with_demo_options``)."""
    if not agent_loop:
        return env
    return replace(env, noisy_messages=agent_loop_messages,
                   reference_messages=lambda task: agent_loop_messages(task, random.Random(0)),
                   tools=(ADD_TOOL,), build_tokenizer=build_agent_tokenizer)
