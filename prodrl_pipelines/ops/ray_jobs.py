"""The entrypoint of every Ray job of a round, run on the cluster:

    python -m prodrl_pipelines.ops.ray_jobs STEP [ARGS...]

``STEPS`` maps a step name to ``module:function`` (imported only when that step runs); the function
takes the remaining arguments and returns a JSON-able dict, which is reported back to the Dagster
step through Pipes (a custom message, ``ops.ray_launch``) when launched by it, or printed as one JSON
line otherwise.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

STEPS = {
    "train": "prodrl_pipelines.ops.ray_train:train_job",
    "evaluate": "prodrl_pipelines.ops.ray_eval:evaluate_job",
    "score": "prodrl_pipelines.ops.ray_scoring:score_job",
    "rescore": "prodrl_pipelines.ops.ray_scoring:rescore_job",
}


def run_step(step: str, args: list[str]) -> dict:
    if step not in STEPS:
        raise SystemExit(f"unknown Ray job step {step!r}; known: {', '.join(sorted(STEPS))}")
    module, fn = STEPS[step].split(":")
    return getattr(importlib.import_module(module), fn)(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(f"usage: python -m prodrl_pipelines.ops.ray_jobs STEP [ARGS...]; steps: {', '.join(STEPS)}")
    if os.environ.get("DAGSTER_PIPES_CONTEXT"):
        from dagster_pipes import open_dagster_pipes

        with open_dagster_pipes() as pipes:
            out = run_step(argv[0], argv[1:])
            pipes.report_custom_message({"result": out})
    else:
        out = run_step(argv[0], argv[1:])
        print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
