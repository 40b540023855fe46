"""The reward settings: which sources score traffic, how their rewards combine, and each source's
parameters. Validated at load; an error names the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_RUBRIC = (
    "You are grading an AI assistant's conversation.\n\n{transcript}\n\n"
    "Rate how well the assistant's final answer solves the user's task, from 0 (useless) to 1 (fully "
    'correct). Reply with JSON only: {{"score": <number between 0 and 1>}}'
)


class RewardSettings(BaseModel):
    """Errors name the flat setting (``rewards_<field>``), as a settings file writes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # reward sources by name (``rewards.sources.source_names``), in priority order for ``first``
    sources: tuple[str, ...] = ("feedback",)
    # how several sources' rewards make one (``rewards.combine.COMBINE_RULES``): ``first`` = the first
    # source in ``sources`` that has a reward; ``weighted`` = sum of weight x reward, once every source has one
    combine: str = "first"
    weights: dict[str, float] = Field(default_factory=dict)
    # versions selection reads, per source (default: each source's current version)
    versions: dict[str, str] = Field(default_factory=dict)
    # grader: ``package.module:function(trajectory) -> float | None``
    grader: str = ""
    # judge: an OpenAI-compatible chat endpoint (``http://host:port/v1``), its model, and a rubric
    # template (``{transcript}``, ``{task_id}``, ``{final_answer}``) whose reply is JSON with ``score``
    judge_endpoint: str = ""
    judge_model: str = ""
    # the environment variable holding the endpoint's API key (sent as a bearer token; never a setting)
    judge_api_key_env: str = ""
    judge_rubric: str = DEFAULT_RUBRIC
    judge_score_key: str = "score"
    judge_max_tokens: int = Field(64, ge=1)
    judge_concurrency: int = Field(8, ge=1)
    judge_timeout_s: float = Field(60.0, gt=0)
    judge_retries: int = Field(3, ge=0)
    # after this many trajectories in a row the judge could not be reached for (timeouts, 5xx), the
    # rest of that scoring pass is not sent (left unscored, asked again next pass): a hung judge costs
    # a few timeouts, not one per trajectory
    judge_breaker_failures: int = Field(5, ge=1)
    # command: a command line given trajectories as JSON lines on stdin, printing rewards (``harnesses.command``)
    command: str = ""
    # inspect: an inspect-ai task ``package.module:task``; a trajectory's task_id names its sample
    inspect_task: str = ""
    # verifiers: a verifiers taskset id, scored in the verifiers environment (``harnesses.verifiers_tasksets``)
    verifiers_taskset: str = ""
    # an episode is complete, and only then scored, once its client posted feedback (any reward row
    # without a scorer version: the end-of-episode signal) or no call came for this many seconds;
    # a scorer's grade older than the episode's last call is stale and scored again (``rewards.completion``)
    idle_seconds: float = Field(300.0, ge=0)

    @model_validator(mode="after")
    def _sources_are_configured(self) -> "RewardSettings":
        from prodrl_pipelines.rewards.combine import COMBINE_RULES
        from prodrl_pipelines.rewards.sources import source_names

        if not self.sources:
            raise ValueError("rewards_sources: name at least one reward source")
        known = source_names()
        for s in self.sources:
            if s not in known:
                raise ValueError(f"rewards_sources: unknown reward source {s!r}; known: {', '.join(known)}")
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"rewards_sources: {list(self.sources)} names a source twice")
        if self.combine not in COMBINE_RULES:
            raise ValueError(f"rewards_combine: unknown rule {self.combine!r}; known: {', '.join(sorted(COMBINE_RULES))}")
        if self.combine == "weighted":
            missing = [s for s in self.sources if s not in self.weights]
            if missing:
                raise ValueError(f"rewards_weights: combine 'weighted' needs a weight for every source; missing {missing}")
        for name in list(self.weights) + list(self.versions):
            if name not in self.sources:
                raise ValueError(f"rewards_weights / rewards_versions: {name!r} is not one of the sources {list(self.sources)}")
        if "grader" in self.sources and ":" not in self.grader:
            raise ValueError(f"rewards_grader: source 'grader' needs grader = 'package.module:function', got {self.grader!r}")
        for src, field, what in (("command", "command", "the command line to run"),
                                 ("inspect", "inspect_task", "the task as 'package.module:task'"),
                                 ("verifiers", "verifiers_taskset", "the taskset id")):
            if src in self.sources and not getattr(self, field).strip():
                raise ValueError(f"rewards_{field}: source {src!r} needs {what}")
        if "inspect" in self.sources and ":" not in self.inspect_task:
            raise ValueError(f"rewards_inspect_task: expected 'package.module:task', got {self.inspect_task!r}")
        if "judge" in self.sources:
            if not self.judge_endpoint.startswith(("http://", "https://")):
                raise ValueError(f"rewards_judge_endpoint: source 'judge' needs an http(s) URL, got {self.judge_endpoint!r}")
            if not self.judge_model:
                raise ValueError("rewards_judge_model: source 'judge' needs the judge's model name")
            if "{transcript}" not in self.judge_rubric and "{final_answer}" not in self.judge_rubric:
                raise ValueError("rewards_judge_rubric: the template must place the conversation ({transcript} or {final_answer})")
        return self

    @property
    def scorers(self) -> tuple[str, ...]:
        """The sources that score stored traffic themselves (all but ``feedback``)."""
        from prodrl_pipelines.rewards.sources import source_factory

        return tuple(s for s in self.sources if source_factory(s).scores)
