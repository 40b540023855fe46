"""The lab's task environments behind one interface, chosen by name (``settings.lab.task``).

Everything that plays, demonstrates or evaluates lab episodes (episodes, warm start, tokenizer,
traffic, rounds) goes through a ``TaskEnv``, so a new task is a module plus one registry entry.
The arithmetic entry is the original module's functions unchanged (the demo's numbers depend on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import Callable

from prodrl_pipelines.lab import arithmetic


@dataclass(frozen=True)
class TaskEnv:
    """One lab task: tasks, the episode environment, demonstrators and the tokenizer corpus.

    ``min_max_tokens``: the smallest deploy ``max_tokens`` a correct answer fits in.
    ``tokenizer_vocab_size``: the BPE vocabulary of the task's lab tokenizer.
    ``sft``: per lab size, overrides of ``warmstart.SFT_DEFAULTS`` for this task.
    ``tools``: tool schemas handed to the chat template (a real model's template renders them; the
    lab templates ignore them, so they cost the lab model no context, except the agent-loop one of
    ``arithmetic_tools``, which renders one compact line per tool).
    ``reply_parser``: what the chat server makes of a reply (``engines.reply_parsers``).
    ``build_tokenizer``: the task's own tokenizer and template (None: ``tokenizer.build_tokenizer``'s
    plain BPE and ChatML template).
    ``demo_options``: the names of the task's opt-in demonstration options (``build_base_policy(...,
    sft={name: value})``); ``apply_demo_options(env, **options)`` returns the task as they show it
    (its demonstrations, tools, tokenizer and template; ``with_demo_options``).
    """

    name: str
    generate_tasks: Callable[[int, int], list]
    heldout_tasks: Callable[[int], list]
    initial_messages: Callable[[object], list[dict]]
    env_reply: Callable[[object, int, str], dict | None]
    reward: Callable[[object, list[str]], float]
    reference_messages: Callable[[object], list[dict]]
    noisy_messages: Callable[..., list[dict]]
    corpus_text: Callable[[], list[str]]
    reward_source: str
    min_max_tokens: int = 1
    tokenizer_vocab_size: int | None = None  # None: tokenizer.DEFAULT_VOCAB_SIZE
    sft: dict[str, dict] = field(default_factory=dict)
    tools: tuple[dict, ...] | None = None
    reply_parser: str = "none"
    build_tokenizer: Callable[[], object] | None = None
    # optional, for the behaviour monitors (``evaluation.monitors``): why one answer is malformed,
    # and a task's held-out slices
    format_error: Callable[[object, str], str | None] | None = None
    task_tags: Callable[[object], tuple[str, ...]] | None = None
    demo_options: tuple[str, ...] = ()
    apply_demo_options: Callable[..., "TaskEnv"] | None = None

    def with_demo_options(self, **options) -> "TaskEnv":
        """The task as the demonstration ``options`` show it (none given: the task itself)."""
        unknown = sorted(set(options) - set(self.demo_options))
        if unknown:
            valid = ", ".join(self.demo_options) or "none"
            raise ValueError(f"lab task {self.name!r} has no demonstration option {', '.join(unknown)} (valid: {valid})")
        if not options or self.apply_demo_options is None:
            return self
        return self.apply_demo_options(self, **options)

    def calibration_messages(self, n: int, seed: int) -> list[list[dict]]:
        """W4A4 calibration prompts: training tasks, not held-out ones (``evaluation.suite``)."""
        return [self.initial_messages(t) for t in self.generate_tasks(n, seed)]


ARITHMETIC = TaskEnv(
    name="arithmetic",
    generate_tasks=arithmetic.generate_tasks,
    heldout_tasks=lambda n: arithmetic.heldout_tasks(n),
    initial_messages=arithmetic.initial_messages,
    env_reply=arithmetic.env_reply,
    reward=arithmetic.reward,
    reference_messages=arithmetic.reference_messages,
    noisy_messages=arithmetic.noisy_messages,
    corpus_text=arithmetic.corpus_text,
    reward_source="lab/arithmetic",
    format_error=arithmetic.format_error,
    task_tags=arithmetic.task_tags,
)

def _chess() -> TaskEnv:
    # python-chess is the `lab` extra: only the chess task needs it
    try:
        from prodrl_pipelines.lab import chess_env
    except ImportError as e:
        raise ValueError(f"lab task 'chess' needs python-chess ({e}): pip install 'prodrl_pipelines[lab]'") from None
    return TaskEnv(
        name="chess",
        generate_tasks=chess_env.generate_tasks,
        heldout_tasks=chess_env.heldout_tasks,
        initial_messages=chess_env.initial_messages,
        env_reply=chess_env.env_reply,
        reward=chess_env.reward,
        reference_messages=chess_env.reference_messages,
        noisy_messages=chess_env.noisy_messages,
        corpus_text=chess_env.corpus_text,
        reward_source="lab/chess",
        min_max_tokens=chess_env.MIN_MAX_TOKENS,
        tokenizer_vocab_size=192,
        # the pool is 4096 puzzles (chess_puzzles.TRAIN_CHUNKS x CHUNK); "tiny" needs one cached chunk
        sft={"tiny": dict(n_tasks=64), "demo": dict(n_tasks=2048, format_noise=0.2)},
        tools=(chess_env.MOVE_TOOL,),
    )


def _arithmetic_tools() -> TaskEnv:
    from prodrl_pipelines.lab import arithmetic_tools as at

    # the arithmetic tasks and split; the text (replies, environment, verifier, tokenizer) is its own
    return replace(
        ARITHMETIC,
        name="arithmetic_tools",
        env_reply=at.env_reply,
        reward=at.reward,
        reference_messages=at.reference_messages,
        noisy_messages=at.noisy_messages,
        corpus_text=at.corpus_text,
        reward_source="lab/arithmetic_tools",
        min_max_tokens=at.MIN_MAX_TOKENS,
        sft={"demo": dict(compact_noise=at.COMPACT_NOISE)},
        tools=(at.ANSWER_TOOL,),
        reply_parser="qwen3",
        build_tokenizer=at.build_tokenizer,
        demo_options=("agent_loop",),  # an agent SDK's loop with an add tool (arithmetic_tools docstring)
        apply_demo_options=at.with_demo_options,
    )


_FACTORIES: dict[str, Callable[[], TaskEnv]] = {"arithmetic": lambda: ARITHMETIC, "chess": _chess,
                                                 "arithmetic_tools": _arithmetic_tools}
_BUILT: dict[str, TaskEnv] = {}


class _Tasks(Mapping):
    """Task name -> ``TaskEnv``, each built on first use."""

    def __getitem__(self, name: str) -> TaskEnv:
        if name not in _BUILT:
            _BUILT[name] = _FACTORIES[name]()
        return _BUILT[name]

    def __iter__(self):
        return iter(_FACTORIES)

    def __len__(self) -> int:
        return len(_FACTORIES)


TASKS: Mapping[str, TaskEnv] = _Tasks()


def __getattr__(name: str):
    if name == "CHESS":
        return TASKS["chess"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_task(name: str | TaskEnv) -> TaskEnv:
    """The task environment called ``name`` (a ``TaskEnv`` passes through)."""
    if isinstance(name, TaskEnv):
        return name
    if name not in _FACTORIES:
        raise ValueError(f"unknown lab task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]
