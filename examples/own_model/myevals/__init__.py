"""The example's held-out tasks as an inspect-ai task: `eval_suite: inspect:myevals:heldout`.
inspect runs it against the served policy (docs/evals.md); the same task scores recorded traffic as
the `inspect` reward source (`rewards_inspect_task: myevals:heldout`)."""

import json
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import match
from inspect_ai.solver import generate

HELDOUT = Path(__file__).resolve().parent.parent / "heldout.jsonl"


@task
def heldout():
    lines = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    samples = [Sample(id=t["task_id"], input=t["messages"][-1]["content"], target=t["answer"],
                      metadata={"digits": len(t["answer"])}) for t in lines]
    # location="begin": the answer starts the reply, as mygrader:reward reads it
    return Task(dataset=samples, solver=generate(), scorer=match(location="begin"))
