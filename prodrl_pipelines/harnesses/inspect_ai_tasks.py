"""inspect-ai tasks as a held-out suite (``eval_suite: "inspect:package.module:task"``) and as a
reward source (``rewards_sources: [inspect]`` with ``rewards_inspect_task``), in this process.

Suite: the task's first ``heldout_size`` samples, in dataset order, run by ``inspect_ai.eval``
against the served policy through inspect's ``openai-api`` provider (chat completions, the
deployment's temperature, top-p, top-k, max tokens and the evaluation seed). A sample's reward is
its first scorer's value as a float (``value_to_float``: C 1, I 0, P 0.5, numbers as they are); a
sample inspect failed on scores 0 and is counted as a reward error. Tags (the per-tag slices): the
metadata's ``tags`` list, and ``key=value`` for each other scalar metadata field.

Reward source: a recorded trajectory's ``task_id`` names the sample it answered. Its scorers run on
a ``TaskState`` of the sample's input followed by the recorded assistant texts (reasoning and tool
-call markup parsed out, as the chat server would), the last one as the output. Version: the task
spec and a hash of its module's source as loaded (editing the scorer makes new reward rows).

Registered as the ``inspect`` suite source and reward source (pyproject's entry points).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from prodrl_pipelines.evaluation.served import ServedEndpoint, ServedEpisode
from prodrl_pipelines.evaluation.suite import SuiteError
from prodrl_pipelines.rewards.outcome import Outcome, checked

PROVIDER = "prodrl"  # openai-api/<provider>/<model>: the provider names nothing but itself here
# inspect refuses two evals at once in a process
_EVAL_LOCK = threading.Lock()


def load_task(spec: str, setting: str = "eval.suite"):
    """The inspect ``Task`` of ``package.module:task`` (a ``@task`` function, called without
    arguments, or a ``Task`` object)."""
    from prodrl_pipelines.evaluation.loading import import_object

    try:
        from inspect_ai import Task
    except ImportError as e:
        raise SuiteError(f"{setting}={spec!r}: inspect-ai is not installed ({e}); install the 'evals' extra") from None
    obj = import_object(spec, setting)
    if callable(obj) and not isinstance(obj, Task):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - the user's task function: say whose and why
            raise SuiteError(f"{setting}={spec!r}: calling the task failed ({type(e).__name__}: {e})") from None
    if not isinstance(obj, Task):
        raise SuiteError(f"{setting}={spec!r}: expected an inspect Task or @task function, got {type(obj).__name__}")
    return obj


def sample_messages(sample) -> list[dict]:
    """A sample's input as chat messages."""
    if isinstance(sample.input, str):
        return [{"role": "user", "content": sample.input}]
    return [{"role": m.role, "content": m.text} for m in sample.input]


def metadata_tags(metadata: dict | None) -> list[str]:
    md = metadata or {}
    tags = [str(t) for t in md.get("tags") or []] if isinstance(md.get("tags"), (list, tuple)) else []
    return tags + [f"{k}={v}" for k, v in md.items() if k != "tags" and isinstance(v, (str, int, float, bool))]


def _first_score(scores: dict | None) -> float:
    from inspect_ai.scorer import value_to_float

    if not scores:
        raise ValueError("no score")
    return float(value_to_float()(next(iter(scores.values())).value))


class _QuietEval:
    """inspect's ``eval`` replaces ``sys.excepthook`` and adds handlers to the root logger: both are
    put back, so an evaluation leaves the process as it found it."""

    def __enter__(self):
        self.hook, self.handlers = sys.excepthook, list(logging.getLogger().handlers)
        self.level = logging.getLogger().level

    def __exit__(self, *exc):
        sys.excepthook = self.hook
        root = logging.getLogger()
        for h in [h for h in root.handlers if h not in self.handlers]:
            root.removeHandler(h)
        root.setLevel(self.level)


class InspectSuite:
    """An inspect task as a served suite (see the module doc)."""

    min_max_tokens = 1
    tools = None

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.name = f"inspect:{spec}"
        task = load_task(spec)
        self.samples = list(task.dataset)
        if not self.samples:
            raise SuiteError(f"eval.suite={self.name!r}: the task's dataset is empty")

    def calibration_messages(self, n: int, seed: int) -> list[list[dict]]:
        return [sample_messages(s) for s in self.samples[:n]]

    def task_tags(self, episode) -> list[str]:
        return list(episode.tags)

    def play_served(self, endpoint: ServedEndpoint, n: int, params, seed: int) -> list[ServedEpisode]:
        from inspect_ai import eval as inspect_eval

        task = load_task(self.spec)  # a fresh Task: solvers and scorers may keep state between runs
        kw = dict(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens, seed=seed)
        if params.top_k:
            kw["extra_body"] = {"top_k": params.top_k}  # the openai-api provider does not send top_k itself
        with tempfile.TemporaryDirectory(prefix="prodrl-inspect-") as logs_dir, _EVAL_LOCK, _QuietEval():
            def run():
                return inspect_eval(task, model=f"openai-api/{PROVIDER}/{endpoint.model}", model_base_url=endpoint.base_url,
                                    model_args={"api_key": endpoint.api_key, "responses_api": False},
                                    limit=n, display="none", log_dir=logs_dir, log_format="json",
                                    fail_on_error=False, max_connections=8, **kw)

            # in a thread of its own: inspect runs its own event loop, which a caller's running loop forbids
            with ThreadPoolExecutor(1, thread_name_prefix="inspect-eval") as pool:
                log = pool.submit(run).result()[0]
            if log.status != "success":
                why = log.error.message if log.error else log.status
                raise SuiteError(f"eval_suite={self.name!r}: inspect's evaluation against {endpoint.base_url} "
                                 f"failed: {why}")
            by_id = {str(s.id): s for s in log.samples if s.epoch == 1}
        order = [str(s.id) for s in task.dataset][:n]
        return [self._episode(tid, by_id.get(tid)) for tid in order]

    @staticmethod
    def _episode(task_id: str, s) -> ServedEpisode:
        if s is None:
            return ServedEpisode(task_id, 0.0, error="inspect returned no result for this sample")
        outputs = [m.text for m in s.messages if m.role == "assistant"]
        gen = sum(int(u.output_tokens or 0) for u in (s.model_usage or {}).values())
        tags = metadata_tags(s.metadata)
        if s.error is not None:
            return ServedEpisode(task_id, 0.0, outputs, tags, s.error.message.strip().splitlines()[0], gen)
        try:
            return ServedEpisode(task_id, _first_score(s.scores), outputs, tags, None, gen)
        except (ValueError, TypeError) as e:
            return ServedEpisode(task_id, 0.0, outputs, tags, f"unscorable: {e}", gen)


def inspect_suite(arg: str, settings=None) -> InspectSuite:
    """The ``inspect`` suite source: ``inspect:package.module:task``."""
    if ":" not in arg:
        raise SuiteError(f"eval_suite='inspect:{arg}': expected 'inspect:package.module:task'")
    return InspectSuite(arg)


class InspectRewardSource:
    name = "inspect"
    scores = True

    def __init__(self, settings) -> None:
        from prodrl_pipelines.evaluation.loading import import_object
        from prodrl_pipelines.rewards.code_version import loaded_code_hash

        self.spec = settings.inspect_task
        self.task = load_task(self.spec, "rewards_inspect_task")
        self.samples = {str(s.id): s for s in self.task.dataset}
        self.version = f"inspect:{self.spec}@{loaded_code_hash(import_object(self.spec, 'rewards_inspect_task'))}"

    def score(self, views: Sequence, progress=None) -> list[Outcome]:
        out = asyncio.run(self._score_all(views)) if views else []
        if progress is not None:
            progress(len(views))
        return out

    async def _score_all(self, views) -> list[Outcome]:
        return list(await asyncio.gather(*(self._score(v) for v in views)))

    async def _score(self, view) -> Outcome:
        from inspect_ai.model import ChatMessageAssistant, ChatMessageUser, ModelName, ModelOutput
        from inspect_ai.scorer import Target
        from inspect_ai.solver import TaskState

        from prodrl_pipelines.engines.reply_parsers import parse_qwen3

        sample = self.samples.get(view.task_id)
        if sample is None:
            return Outcome(None, f"task_id {view.task_id!r} is not a sample of inspect task {self.spec!r}")
        inp = [ChatMessageUser(content=sample.input)] if isinstance(sample.input, str) else list(sample.input)
        # an output without </think> is graded as the answer (vLLM's parser would make it all reasoning)
        texts = [parse_qwen3(o, thinking="</think>" in o).get("content") or "" for o in view.outputs]
        model = f"openai-api/{PROVIDER}/{view.metadata.get('policy_version') or 'recorded'}"
        state = TaskState(model=ModelName(model), sample_id=sample.id, epoch=1, input=sample.input,
                          messages=inp + [ChatMessageAssistant(content=t) for t in texts],
                          target=Target(sample.target), output=ModelOutput.from_content(model=model, content=texts[-1] if texts else ""),
                          metadata=dict(sample.metadata or {}))
        scorers = self.task.scorer if isinstance(self.task.scorer, list) else [self.task.scorer]
        try:
            score = await scorers[0](state, Target(sample.target))
            from inspect_ai.scorer import value_to_float

            return checked(float(value_to_float()(score.value)), f"inspect task {self.spec}")
        except Exception as e:  # noqa: BLE001 - a scorer bug leaves the trajectory pending, with why
            return Outcome(None, f"{type(e).__name__}: {e}")
