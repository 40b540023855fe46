"""Suites whose harness is someone else's: it drives the model over HTTP and reports rewards.

An inspect-ai task, a verifiers taskset or any command that talks to an OpenAI-compatible server
plays its own episodes; what this project owns is the server it talks to and what the gate, the
monitors and the slices read back. Such a suite (``ServedSuite``) has, instead of the episode hooks
of ``suite.EvalSuite``:

- ``play_served(endpoint, n, params, seed)``: play the first ``n`` held-out tasks against
  ``endpoint`` (``ServedEndpoint``: base URL ending in ``/v1``, model name, API key) with the
  deployment's sampling ``params`` and ``seed``, and return one ``ServedEpisode`` per task, always in
  the same task order (the gate pairs the candidate's and the live policy's rewards task by task);
- ``name``; optional ``calibration_messages(n, seed)`` (W4A4 calibration and the export's smoke
  prompts; default: a few generic prompts).

``evaluate_served`` serves an export the way ``prodrl serve`` serves it (the same app, in this
process, on a loopback port, named as the policy version) and counts every call it answers, so the
KL monitor reads the candidate's own calls as with built-in suites. Given an endpoint instead (the
live deployment), the harness talks to it directly and no calls are kept.
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prodrl_pipelines.engines.types import SamplingParams

@dataclass(frozen=True)
class ServedEndpoint:
    base_url: str  # ends in /v1
    model: str
    api_key: str = "EMPTY"


@dataclass
class ServedEpisode:
    task_id: str
    reward: float
    outputs: list[str] = field(default_factory=list)  # the assistant texts, one per model call
    tags: list[str] = field(default_factory=list)
    error: str | None = None  # the harness's own error for this task (scored 0)
    gen_tokens: int | None = None  # as the harness counted them; None: the outputs re-tokenized


class CallLog:
    """The engine behind the loopback server, with every generate call it ran kept (prompt ids,
    output ids, processed logprobs): the KL monitor's input."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], list[int], list[float]]] = []
        self._lock = threading.Lock()

    def generate(self, prompts, params, seed=None):
        records = self.engine.generate(prompts, params, seed=seed)
        with self._lock:
            self.calls += [(list(r.prompt_token_ids), list(r.output_token_ids), list(r.output_logprobs))
                           for r in records]
        return records

    def __getattr__(self, name):  # tokenizer, model, vocab_size, score, ...
        return getattr(self.engine, name)


@contextlib.contextmanager
def loopback_server(settings, export_dir: str | Path, policy_version: str):
    """``prodrl serve``'s app on ``export_dir`` (NVFP4 dequantised, as deployed) on a loopback port,
    named ``policy_version``, with the deployment's reply parser and sampling defaults (a harness
    that sends no temperature samples as the deployment does). Yields (endpoint, call log)."""
    from prodrl_pipelines.engines.server import BackgroundServer, build_app
    from prodrl_pipelines.evaluation.batches import load_engine

    engine, _ = load_engine(export_dir)
    log = CallLog(engine)
    d = settings.deploy
    app = build_app(log, model_dir=str(export_dir), served_model_name=policy_version,
                    reply_parser=d.reply_parser, max_logprobs=max(20, d.num_top_logprobs))
    app.state.serve.info.defaults = {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k}
    with BackgroundServer(app) as server:
        yield ServedEndpoint(f"{server.url}/v1", policy_version), log


def evaluate_served(settings, suite, export_dir: str | Path, policy_version: str, engine=None,
                    keep_calls: bool = False) -> dict:
    """``evaluate_policy``'s result for a served suite (see the module doc); ``engine``: an endpoint
    client (``VLLMClient``) to evaluate through instead of a loopback server on the export."""
    from prodrl_pipelines.evaluation.monitors import episode_facts
    from prodrl_pipelines.evaluation.statistics import mean_confidence_interval

    n, seed = settings.eval.heldout_size, settings.eval.eval_seed
    params = settings.deploy.sampling()
    log = None
    if engine is not None and getattr(engine, "base_url", None):
        from prodrl_pipelines.config import environment

        endpoint = ServedEndpoint(_v1(engine.base_url), engine.model, environment.eval_api_key() or "EMPTY")
        eps = _play(suite, endpoint, n, params, seed)
        tokenizer = engine.tokenizer
    else:
        with loopback_server(settings, export_dir, policy_version) as (endpoint, log):
            eps = _play(suite, endpoint, n, params, seed)
        tokenizer = log.engine.tokenizer
    rewards = [float(e.reward) for e in eps]
    errors = [e.error for e in eps if e.error]
    mean, ci = mean_confidence_interval(np.asarray(rewards))
    refusal = re.compile(settings.monitors.refusal_pattern)
    facts = [episode_facts(suite, e, list(e.outputs), _gen_tokens(e, tokenizer), refusal) for e in eps]
    out = {"policy_version": policy_version, "task_ids": [e.task_id for e in eps], "rewards": rewards,
           "mean": mean, "ci95": ci, "num_tasks": len(eps), "heldout_size": n, "reward_errors": len(errors),
           "first_reward_error": errors[0] if errors else "", "facts": facts, "harness": suite.name}
    if keep_calls:
        out["calls"] = list(log.calls) if log is not None else []
    return out


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _play(suite, endpoint: ServedEndpoint, n: int, params: SamplingParams, seed: int) -> list[ServedEpisode]:
    from prodrl_pipelines.evaluation.suite import SuiteError

    eps = list(suite.play_served(endpoint, n, params, seed))
    if not eps:
        raise SuiteError(f"suite {suite.name!r} played no task against {endpoint.base_url}")
    seen: set[str] = set()
    for e in eps:
        if e.task_id in seen:
            raise SuiteError(f"suite {suite.name!r} reported task {e.task_id!r} twice")
        seen.add(e.task_id)
    return eps[:n]


def _gen_tokens(ep: ServedEpisode, tokenizer) -> int:
    if ep.gen_tokens is not None:
        return int(ep.gen_tokens)
    return sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in ep.outputs)
