"""A fast multi-turn arithmetic task with a verifiable reward (DESIGN.md section 9).

One episode is a short running computation, one model call per operation::

    user:      12+7
    assistant: 19
    user:      then -3
    assistant: 16
    user:      then +5
    assistant: 21

Each assistant turn is checked against the conversation as the model saw it: turn 1 must equal
``a op b``; turn t >= 2 must equal ``previous op c`` where ``previous`` is the model's own previous
answer (what "then -3" refers to), or the true running value when that answer did not parse as an
integer.

Reward = fraction of turns answered correctly, in [0, 1]. Partial credit gives REINFORCE a denser
signal than all-or-nothing (with ~40% per-turn accuracy an all-or-nothing reward over 2-3 turns is
0 for most episodes and the baseline-subtracted advantages are mostly noise), and judging each turn
against the model's own previous answer credits each call for its own arithmetic.

Answers must be bare integers: ``"=16"`` or ``"16 apples"`` are malformed (wrong for that turn).
``noisy_messages`` produces the transcripts of a sloppy demonstrator for the warm start.

Held-out tasks are disjoint from training tasks by construction: a task's identity is a hash of its
content, and a fixed 1-in-10 slice of that hash space is reserved for evaluation.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

# Task distribution (difficulty knobs; the demo base policy is tuned against these defaults).
FIRST_OPERAND_RANGE = (0, 9)  # inclusive: a and b of the first turn
LATER_OPERAND_RANGE = (1, 9)  # inclusive: c of each "then op c" turn
TURNS_RANGE = (2, 3)  # inclusive: model calls per episode
OPS = ("+", "-")
HELDOUT_SEED = 20261129
_HELDOUT_BUCKETS = 10  # 1 in 10 of the content-hash space is held out

_INT_RE = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ArithmeticTask:
    """``numbers[0] ops[0] numbers[1]``, then ``ops[i] numbers[i+1]`` for each further turn."""

    task_id: str
    numbers: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def n_turns(self) -> int:
        return len(self.ops)

    def prompt(self, turn: int) -> str:
        """The user message of assistant turn ``turn`` (0-based)."""
        if turn == 0:
            return f"{self.numbers[0]}{self.ops[0]}{self.numbers[1]}"
        return f"then {self.ops[turn]}{self.numbers[turn + 1]}"

    def true_values(self) -> list[int]:
        """The correct running value after each turn."""
        values, v = [], self.numbers[0]
        for op, x in zip(self.ops, self.numbers[1:]):
            v = apply_op(v, op, x)
            values.append(v)
        return values


def apply_op(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown op {op!r}")


def _content_key(numbers: tuple[int, ...], ops: tuple[str, ...]) -> str:
    return " ".join(str(n) for n in numbers) + "|" + "".join(ops)


def _task_id(numbers: tuple[int, ...], ops: tuple[str, ...]) -> str:
    return "arith-" + hashlib.sha256(_content_key(numbers, ops).encode()).hexdigest()[:16]


def is_heldout(task: ArithmeticTask) -> bool:
    """True when the task lives in the held-out slice of the task space."""
    return int(task.task_id.split("-")[1], 16) % _HELDOUT_BUCKETS == 0


def _sample_task(rng: random.Random) -> ArithmeticTask:
    n_turns = rng.randint(*TURNS_RANGE)
    numbers = [rng.randint(*FIRST_OPERAND_RANGE), rng.randint(*FIRST_OPERAND_RANGE)]
    numbers += [rng.randint(*LATER_OPERAND_RANGE) for _ in range(n_turns - 1)]
    ops = tuple(rng.choice(OPS) for _ in range(n_turns))
    nums = tuple(numbers)
    return ArithmeticTask(task_id=_task_id(nums, ops), numbers=nums, ops=ops)


def _generate(n: int, seed: int, heldout: bool) -> list[ArithmeticTask]:
    rng = random.Random(f"arithmetic:{seed}")
    tasks: list[ArithmeticTask] = []
    while len(tasks) < n:
        t = _sample_task(rng)
        if is_heldout(t) == heldout:
            tasks.append(t)
    return tasks


def generate_tasks(n: int, seed: int) -> list[ArithmeticTask]:
    """``n`` training tasks, deterministic in ``seed``, never in the held-out slice (repeats possible)."""
    return _generate(n, seed, heldout=False)


def heldout_tasks(n: int = 256, seed: int = HELDOUT_SEED) -> list[ArithmeticTask]:
    """The fixed held-out evaluation set (disjoint from every ``generate_tasks`` output)."""
    return _generate(n, seed, heldout=True)


# ----------------------------------------------------------------------------------- episode env


def initial_messages(task: ArithmeticTask) -> list[dict]:
    """The conversation before the first model call."""
    return [{"role": "user", "content": task.prompt(0)}]


def env_reply(task: ArithmeticTask, turn: int, assistant_text: str) -> dict | None:
    """The environment's message after assistant turn ``turn`` (0-based), or None when the episode ends."""
    del assistant_text  # the next operation does not depend on the answer; the reward does
    if turn + 1 >= task.n_turns:
        return None
    return {"role": "user", "content": task.prompt(turn + 1)}


def parse_answer(text: str) -> int | None:
    """An answer is a bare (optionally negative) integer, surrounding whitespace allowed."""
    s = text.strip()
    return int(s) if _INT_RE.fullmatch(s) else None


def turn_correct(task: ArithmeticTask, assistant_texts: list[str], parse=None) -> list[bool]:
    """Per-turn correctness, each turn judged against the conversation the model saw (``parse``:
    reply text -> its integer answer or None; default ``parse_answer``, a bare integer)."""
    parse = parse or parse_answer
    out: list[bool] = []
    truth = task.true_values()
    prev = task.numbers[0]
    for turn in range(task.n_turns):
        expected = apply_op(prev, task.ops[turn], task.numbers[turn + 1])
        got = parse(assistant_texts[turn]) if turn < len(assistant_texts) else None
        out.append(got is not None and got == expected)
        prev = got if got is not None else truth[turn]
    return out


def reward(task: ArithmeticTask, assistant_texts: list[str], parse=None) -> float:
    """Fraction of the task's turns answered correctly (missing turns count as wrong), in [0, 1]."""
    ok = turn_correct(task, assistant_texts, parse)
    return sum(ok) / task.n_turns


def format_error(task: ArithmeticTask, text: str) -> str | None:
    """Why an answer is malformed (anything but a bare integer), or None."""
    return None if parse_answer(text) is not None else f"not a bare integer: {text.strip()[:40]!r}"


def task_tags(task: ArithmeticTask) -> tuple[str, ...]:
    """Held-out slices: the number of turns and the first operation."""
    return (f"turns={task.n_turns}", f"first_op={task.ops[0]}")


def reference_answers(task: ArithmeticTask) -> list[str]:
    """The correct assistant messages (used for the supervised warm start)."""
    return [str(v) for v in task.true_values()]


def reference_messages(task: ArithmeticTask) -> list[dict]:
    """A full correct transcript."""
    msgs: list[dict] = []
    for turn, ans in enumerate(reference_answers(task)):
        msgs.append({"role": "user", "content": task.prompt(turn)})
        msgs.append({"role": "assistant", "content": ans})
    return msgs


SLOPPY_PREFIX = "="  # how a sloppy demonstrator sometimes writes an answer: "=12" (rejected by the verifier)


def noisy_messages(
    task: ArithmeticTask,
    rng: random.Random,
    answer_noise: float = 0.0,
    format_noise: float = 0.0,
    hedge_noise: float = 0.0,
) -> list[dict]:
    """A transcript from a sloppy demonstrator.

    Each answer is off by 1 or 2 with probability ``answer_noise``, and written as ``"=12"`` instead
    of ``"12"`` with probability ``format_noise`` (the verifier only accepts a bare integer). With
    probability ``hedge_noise`` it hedges: ``"12 13"``, the value and a neighbour in random order
    (malformed for the verifier; a grader that accepts the right number anywhere pays for it, the
    reward hack of ``lab.graders``). Later turns apply their operation to the value shown (to the
    true value after a hedge, which does not parse).
    """
    msgs: list[dict] = []
    prev = task.numbers[0]
    for turn in range(task.n_turns):
        value = apply_op(prev, task.ops[turn], task.numbers[turn + 1])
        if answer_noise > 0 and rng.random() < answer_noise:
            value += rng.choice((-2, -1, 1, 2))
        text = str(value)
        if format_noise > 0 and rng.random() < format_noise:
            text = SLOPPY_PREFIX + text
        if hedge_noise > 0 and rng.random() < hedge_noise:
            other = value + rng.choice((-1, 1))
            text = f"{value} {other}" if rng.random() < 0.5 else f"{other} {value}"
            value = task.true_values()[turn]  # a hedge does not parse: the next turn builds on the true value
        msgs.append({"role": "user", "content": task.prompt(turn)})
        msgs.append({"role": "assistant", "content": text})
        prev = value
    return msgs


def corpus_text(n: int = 2000, seed: int = 0) -> list[str]:
    """Task text (user and assistant contents) for training the tokenizer."""
    texts: list[str] = []
    for t in _generate(n, seed, heldout=False) + _generate(n // 10, seed, heldout=True):
        texts.extend(m["content"] for m in reference_messages(t))
    return texts
