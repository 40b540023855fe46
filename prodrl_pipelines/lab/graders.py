"""Graders of recorded lab traffic (``rewards_grader``), for the reward-hacking walkthrough.

Both read the task back from what was recorded: each call's last user message (``12+7``,
``then -3``) in its rendered prompt, as a grader of production traffic reads the conversation.

- ``arithmetic_anywhere`` has a hole: a turn counts as correct when the right number appears
  anywhere in the answer, so hedging (``"12 13"``) and spraying numbers pay;
- ``arithmetic_exact`` is the fix: the answer must be the bare integer (the held-out suite's rule).
"""

from __future__ import annotations

import re

from prodrl_pipelines.lab.arithmetic import apply_op, parse_answer
from prodrl_pipelines.lab.tokenizer import IM_END, IM_START

_FIRST = re.compile(r"^\s*(-?\d+)\s*([+-])\s*(-?\d+)\s*$")
_THEN = re.compile(r"^\s*then\s*([+-])\s*(-?\d+)\s*$")
_INTS = re.compile(r"-?\d+")


def last_user_message(prompt: str) -> str:
    head = f"{IM_START}user\n"
    if head not in prompt:
        raise ValueError(f"no user message in the prompt: {prompt[-80:]!r}")
    return prompt.rsplit(head, 1)[1].split(IM_END, 1)[0]


def _turns(trajectory) -> list[tuple[str, int]]:
    """Per call: (operation, operand); the first call's ``a op b`` gives ("=", a) then (op, b)."""
    out = []
    for i, p in enumerate(trajectory.prompts):
        msg = last_user_message(p)
        if i == 0:
            m = _FIRST.match(msg)
            if not m:
                raise ValueError(f"first user message is not 'a+b' or 'a-b': {msg!r}")
            out.append((m.group(2), int(m.group(1)), int(m.group(3))))
        else:
            m = _THEN.match(msg)
            if not m:
                raise ValueError(f"user message {i} is not 'then +c' / 'then -c': {msg!r}")
            out.append((m.group(1), None, int(m.group(2))))
    return out


def _grade(trajectory, correct) -> float:
    turns = _turns(trajectory)
    if not turns:
        return None
    prev = truth = turns[0][1]
    hits = 0
    for (op, _, c), text in zip(turns, trajectory.outputs):
        expected, truth = apply_op(prev, op, c), apply_op(truth, op, c)
        hits += bool(correct(text, expected))
        got = parse_answer(text)
        prev = got if got is not None else truth
    return hits / len(turns)


def arithmetic_anywhere(trajectory) -> float | None:
    """The holey grader: the right number anywhere in the answer counts."""
    return _grade(trajectory, lambda text, expected: expected in {int(x) for x in _INTS.findall(text)})


def arithmetic_exact(trajectory) -> float | None:
    """The fixed grader: the answer must be exactly the right bare integer."""
    return _grade(trajectory, lambda text, expected: parse_answer(text) == expected)
