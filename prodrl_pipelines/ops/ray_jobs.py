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
import socket
import sys
from pathlib import Path

STEPS = {
    "train": "prodrl_pipelines.ops.ray_train:train_job",
    "evaluate": "prodrl_pipelines.ops.ray_eval:evaluate_job",
    "score": "prodrl_pipelines.ops.ray_scoring:score_job",
    "rescore": "prodrl_pipelines.ops.ray_scoring:rescore_job",
}


def check_store_here(environ=os.environ) -> None:
    """A local store (no S3 bucket) is a directory of the driver's disk: a node that does not share
    that disk would read nothing and write where nobody looks, so the job stops naming the fix."""
    from prodrl_pipelines.config import environment

    store = environment.read_store(environ)
    where = store["root"] or environment.read_settings(environ).get("home", "")
    if not store["s3_bucket"] and where and Path(where).is_absolute() and not Path(where).is_dir():
        raise SystemExit(f"the store {where} (a local directory) is not on Ray node {socket.gethostname()}: a local "
                         f"store serves a cluster whose nodes share the driver's disk only; give the round an S3 "
                         f"store (PRODRL_S3_BUCKET, PRODRL_S3_ENDPOINT_URL)")


def run_step(step: str, args: list[str]) -> dict:
    if step not in STEPS:
        raise SystemExit(f"unknown Ray job step {step!r}; known: {', '.join(sorted(STEPS))}")
    check_store_here()
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
