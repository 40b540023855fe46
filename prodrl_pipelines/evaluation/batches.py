"""A held-out evaluation's episodes in batches: the unit every episode runner plays.

The episodes are cut into batches of ``eval.episode_batch`` (0: one batch of every task), and batch
``b`` is played on its own with seed ``batch_seed(eval_seed, b)`` and its slice of the evaluation's
trajectory ids. The local engine's samples depend on what shares a batch (one generator per call
draws for the rows still active; padding and batch size enter the forward pass), so the batch, not
the worker, is the unit: every runner (``runners``) plays the same batches with the same seeds, and
the merged episodes are the same whoever played them. Batch 0 keeps ``eval_seed`` itself, so a
one-batch evaluation is exactly the unbatched one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.evaluation.episodes import PlayedEpisode, play_episodes, stop_token_ids, trajectory_ids


class EvalShardError(RuntimeError):
    """A batch of a held-out evaluation could not be played; the message names the batch and worker."""


def batch_seed(seed: int, b: int) -> int:
    """The sampling seed of batch ``b``: ``seed`` itself for batch 0, a draw seeded by both after."""
    return int(seed) if b == 0 else random.Random(f"episode-batch:{seed}:{b}").getrandbits(31)


@dataclass(frozen=True)
class EpisodeWork:
    """One evaluation's episodes, as handed to a worker (picklable: the suite travels with it)."""

    export_dir: str
    policy_version: str
    suite: object
    tasks: list
    params: SamplingParams
    seed: int
    batch: int = 0  # episodes per batch; 0: all in one

    def batches(self) -> list[range]:
        n = len(self.tasks)
        size = self.batch if self.batch > 0 else max(n, 1)
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    def describe(self, b: int) -> str:
        r = self.batches()[b]
        return (f"shard {b + 1}/{len(self.batches())} (episodes {r.start}-{r.stop - 1}) of {self.policy_version} "
                f"at {self.export_dir}")


def load_engine(export_dir: str | Path):
    """The local engine on an export as deployed (NVFP4 dequantised; a LoRA round's export served by an
    adapter target: its base export with the adapter folded in) and its stop tokens."""
    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.quant.adapter_export import adapter_export, served_as_adapter

    if served_as_adapter(export_dir):
        from prodrl_pipelines.engines.serve_adapters import adapter_engine

        adapter, _, base_export = adapter_export(export_dir)
        engine = adapter_engine(LocalEngine.from_pretrained(base_export), adapter)
    else:
        engine = LocalEngine.from_pretrained(export_dir)
    return engine, stop_token_ids(engine.tokenizer, export_dir)


def play_batch(engine, stops: tuple[int, ...], work: EpisodeWork, b: int) -> list[PlayedEpisode]:
    """Batch ``b`` of ``work``, with its own seed and its slice of the evaluation's trajectory ids."""
    r = work.batches()[b]
    ids = trajectory_ids(work.policy_version, work.seed, len(work.tasks))[r.start:r.stop]
    return play_episodes(engine, engine.tokenizer, work.suite, work.tasks[r.start:r.stop], work.params,
                         work.policy_version, batch_seed(work.seed, b), stops=stops, ids=ids)


class EngineCache:
    """The engines a worker has loaded, by export directory: the newest ``keep`` (an evaluation
    alternates between the candidate and the live policy)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._engines: dict[str, tuple] = {}

    def get(self, export_dir: str | Path) -> tuple:
        key = str(export_dir)
        if key not in self._engines:
            while len(self._engines) >= self.keep:
                self._engines.pop(next(iter(self._engines)))
            self._engines[key] = load_engine(key)
        return self._engines[key]
