"""Synthetic recorded trajectories shaped like production traffic, for training benchmarks.

Three shapes (lognormal lengths, seeded): ``chat`` (one call: a prompt and an answer), ``tool`` (a
system prompt and up to 8 tool-using calls) and ``coding`` (up to 24 calls with long tool results:
file contents, test output). Every call's prompt ids extend the previous call's prompt + output ids
by the tool result and the next turn, as a chat template that keeps history renders them; with
``break_every=n`` every n-th call instead re-renders the previous output (its first token changes),
as a template that drops earlier reasoning does. Each generated position carries a recorded top-K
head, so every correction can run on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prodrl_pipelines.rl.trajectory import Call, Trajectory


@dataclass(frozen=True)
class Shape:
    max_calls: int
    system: float  # median tokens of the system prompt + first user turn
    output: float  # median tokens of one model output
    between: float  # median tokens between two calls (tool result, next user turn)
    sigma: float = 0.6  # lognormal spread


SHAPES = {
    "chat": Shape(max_calls=1, system=600, output=300, between=0),
    "tool": Shape(max_calls=8, system=700, output=150, between=280),
    "coding": Shape(max_calls=24, system=1500, output=260, between=700),
}


def _lognormal(rng, median: float, sigma: float, scale: float) -> int:
    return max(1, int(round(median * scale * float(rng.lognormal(0.0, sigma)))))


def shaped_trajectory(rng, shape: Shape, vocab: int, tid: str, *, scale: float = 1.0, break_every: int = 0,
                      head: int = 4, max_len: int | None = None) -> Trajectory:
    """One trajectory of ``shape`` (lengths times ``scale``; calls stop before ``max_len`` tokens)."""
    n_calls = int(rng.integers(1, shape.max_calls + 1))
    prompt = rng.integers(3, vocab, _lognormal(rng, shape.system, shape.sigma, scale)).tolist()
    calls = []
    for j in range(n_calls):
        n_out = _lognormal(rng, shape.output, shape.sigma, scale)
        if max_len is not None and len(prompt) + n_out > max_len:
            break
        outs = rng.integers(3, vocab, n_out).tolist()
        top_ids = [[a] + rng.integers(3, vocab, head - 1).tolist() for a in outs]
        top_lps = np.sort(np.log(rng.dirichlet(np.ones(head), size=n_out) * 0.95), axis=1)[:, ::-1]
        calls.append(Call(prompt, outs, top_lps[:, 0].tolist(), 1.0, top_ids, top_lps.tolist(),
                          support_complete=False, top_k=0, top_p=1.0))
        shown = list(outs)
        if break_every and (j + 1) % break_every == 0:
            shown[0] = 3 + (shown[0] - 2) % (vocab - 3)  # the template re-rendered the output
        between = rng.integers(3, vocab, _lognormal(rng, shape.between, shape.sigma, scale)).tolist()
        prompt = prompt + shown + between
    if not calls:  # the first call alone was too long: keep a short one
        return shaped_trajectory(rng, shape, vocab, tid, scale=scale * 0.5, break_every=break_every, head=head,
                                 max_len=max_len)
    return Trajectory(tid, tid, "v0", float(rng.random() < 0.5), calls)


def shaped_minibatch(name: str, n: int, vocab: int, seed: int = 0, **kw) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [shaped_trajectory(rng, SHAPES[name], vocab, f"{name}-{i:04d}", **kw) for i in range(n)]
