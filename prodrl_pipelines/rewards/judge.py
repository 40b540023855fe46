"""An LLM judge as a reward source: a rubric prompt with the conversation, sent to an
OpenAI-compatible chat endpoint at temperature 0, the score parsed from the JSON it answers.

Requests run concurrently (``judge_concurrency``), each with a timeout (``judge_timeout_s``) and
retries with exponential backoff on transport errors, 429 and 5xx (``judge_retries``). A circuit
breaker stops a scoring pass from sending more once ``judge_breaker_failures`` trajectories in a row
found the judge unreachable, and a ``deadline`` (set by a caller with a time budget, the canary
sensor's tick) bounds every attempt: what is not asked stays unscored, asked again next pass. A reply
without a parsable score is an error for that trajectory (it stays unscored), not a retry: the same
prompt at temperature 0 answers the same. The version hashes the model, rubric and score key, so a
new rubric makes new reward rows beside the old ones. The rubric is filled at its placeholders only
(``fill_rubric``): its other braces, a JSON example of the reply included, are its own text.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import httpx

from prodrl_pipelines.rewards.outcome import Outcome, checked, short_hash
from prodrl_pipelines.rewards.view import TrajectoryView

_JSON_OBJECT = re.compile(r"\{.*?\}", re.DOTALL)
RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


PLACEHOLDERS = ("transcript", "task_id", "final_answer")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


def fill_rubric(rubric: str, **values: str) -> str:
    """The rubric with ``{transcript}``, ``{task_id}`` and ``{final_answer}`` filled. A rubric written
    for ``str.format`` (every literal brace doubled, as the default) reads as it always did; any
    other is filled at those three placeholders only, every other brace kept as written (a literal
    ``{"score": x}`` would make ``str.format`` raise). The values are never scanned again."""
    try:
        return rubric.format(**values)
    except (KeyError, IndexError, ValueError, AttributeError):
        return _PLACEHOLDER.sub(lambda m: values[m.group(1)], rubric)


def parse_score(content: str, key: str) -> float | None | str:
    """The score in a judge's reply: the first JSON object holding ``key`` (a code fence or prose
    around it is tolerated). Returns the number, or an error string."""
    for m in _JSON_OBJECT.finditer(content or ""):
        try:
            obj = json.loads(m.group(0))
        except ValueError:
            continue
        if isinstance(obj, dict) and key in obj:
            return obj[key]
    return f"the judge's reply holds no JSON object with {key!r}: {content[:200]!r}"


class JudgeSource:
    name = "judge"
    scores = True

    def __init__(self, settings, *, sleep=time.sleep, clock=time.monotonic) -> None:
        self.s = settings
        self.url = settings.judge_endpoint.rstrip("/") + "/chat/completions"
        self.version = f"{settings.judge_model}@{short_hash(settings.judge_model, settings.judge_rubric, settings.judge_score_key)}"
        self._sleep, self._clock = sleep, clock
        self.deadline: float | None = None  # on ``clock``: no attempt starts or runs past it
        self._lock = threading.Lock()
        self._unreachable, self._last_failure = 0, ""  # trajectories in a row, per scoring pass

    def _refusal(self) -> str | None:
        """Why this pass sends no more (the breaker is open, the time budget is spent), else None."""
        with self._lock:
            if self._unreachable >= self.s.judge_breaker_failures:
                return (f"judge circuit open: {self._unreachable} trajectories in a row could not reach "
                        f"{self.url} ({self._last_failure}); not asked in this pass")
        if self.deadline is not None and self._clock() >= self.deadline:
            return "the scoring pass's time budget is spent; not asked in this pass"
        return None

    def _reached(self, ok: bool, failure: str = "") -> None:
        with self._lock:
            self._unreachable = 0 if ok else self._unreachable + 1
            self._last_failure = failure or self._last_failure

    def prompt(self, view: TrajectoryView) -> str:
        return fill_rubric(self.s.judge_rubric, transcript=view.transcript, task_id=view.task_id,
                           final_answer=view.outputs[-1] if view.outputs else "")

    def _ask(self, client: httpx.Client, view: TrajectoryView) -> Outcome:
        body = {"model": self.s.judge_model, "temperature": 0.0, "max_tokens": self.s.judge_max_tokens,
                "messages": [{"role": "user", "content": self.prompt(view)}]}
        last = ""
        for attempt in range(self.s.judge_retries + 1):
            if attempt:
                self._sleep(max(0.0, min(0.5 * 2 ** (attempt - 1), 8.0, self._left())))
            refused = self._refusal()
            if refused is not None:  # not a failure of the judge: this pass stops asking
                return Outcome(None, refused if not last else f"{refused}; last attempt: {last}")
            try:
                r = client.post(self.url, json=body, timeout=min(self.s.judge_timeout_s, max(self._left(), 0.001)))
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code in RETRY_STATUS:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            self._reached(True)
            if r.status_code != 200:
                return Outcome(None, f"HTTP {r.status_code} from {self.url}: {r.text[:200]}")
            try:
                content = r.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                return Outcome(None, f"not a chat completion from {self.url}: {r.text[:200]}")
            score = parse_score(content or "", self.s.judge_score_key)
            if isinstance(score, str):
                return Outcome(None, score)
            return checked(score, f"judge {self.s.judge_model}")
        self._reached(False, last)
        return Outcome(None, f"judge at {self.url} failed after {self.s.judge_retries + 1} attempts: {last}")

    def _left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - self._clock()

    def headers(self) -> dict:
        import os

        if not self.s.judge_api_key_env:
            return {}
        key = os.environ.get(self.s.judge_api_key_env, "")
        if not key:
            raise ValueError(f"rewards_judge_api_key_env={self.s.judge_api_key_env!r}: that environment variable is "
                             "not set")
        return {"Authorization": f"Bearer {key}"}

    def score(self, views: Sequence[TrajectoryView], progress=None) -> list[Outcome]:
        with self._lock:  # a new pass: the breaker closes
            self._unreachable, self._last_failure = 0, ""
        with httpx.Client(timeout=self.s.judge_timeout_s, headers=self.headers()) as client, \
                ThreadPoolExecutor(self.s.judge_concurrency, thread_name_prefix="judge") as pool:
            futures = [pool.submit(self._ask, client, v) for v in views]
            out = []
            for f in futures:
                out.append(f.result())
                if progress is not None:
                    progress(1)
            return out
