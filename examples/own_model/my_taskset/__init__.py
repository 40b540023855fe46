"""The example's held-out tasks as a verifiers taskset, id `my-taskset`: `eval_suite: verifiers:my-taskset`
(run in verifiers' own environment, `make verifiers`, with this directory on PYTHONPATH; docs/evals.md)."""

import json
from pathlib import Path

import verifiers.v1 as vf

HELDOUT = Path(__file__).resolve().parent.parent / "heldout.jsonl"


class HeldoutData(vf.TaskData):
    answer: str


class HeldoutTask(vf.Task[HeldoutData]):
    @vf.reward(weight=1.0)
    async def starts_with_answer(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.startswith(self.data.answer) else 0.0


class HeldoutConfig(vf.TasksetConfig):
    pass


class HeldoutTaskset(vf.Taskset[HeldoutTask, HeldoutConfig]):
    def load(self):
        for line in HELDOUT.read_text().splitlines():
            if line.strip():
                t = json.loads(line)
                yield HeldoutTask(HeldoutData(id=t["task_id"], prompt=t["messages"][-1]["content"], answer=t["answer"]),
                                  self.config.task)


__all__ = ["HeldoutTaskset"]
