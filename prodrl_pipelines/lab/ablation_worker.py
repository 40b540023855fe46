"""One ablation worker subprocess (``python -m prodrl_pipelines.lab.ablation_worker _worker SPEC``),
started by :mod:`prodrl_pipelines.lab.ablation_runner`: it either builds a shared round-0 base policy
or runs the lab loop (``lab.demo.run_loop``) for one (recipe, seed) in its own home, and writes
``result.json`` or ``failed.json``."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from prodrl_pipelines.storage.atomic import write_json_atomic

# Test hook: ``PRODRL_ABLATION_FAIL_RECIPES=a,b`` makes the workers of those recipes fail at start (the
# tests use it to exercise failed-run handling with a real subprocess).
FAIL_ENV = "PRODRL_ABLATION_FAIL_RECIPES"


def run_spec(spec_path: str) -> int:
    """Do what the spec file the runner wrote says; the exit code (0 = done) goes back to the runner."""
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.time()
    if spec["kind"] == "run":
        failed = Path(spec["failed"])
        failed.unlink(missing_ok=True)
        if spec["recipe"] in [r for r in os.environ.get(FAIL_ENV, "").split(",") if r]:
            err = f"RuntimeError: injected failure for recipe {spec['recipe']!r} ({FAIL_ENV})"
            print(err, flush=True)
            write_json_atomic(failed, {"recipe": spec["recipe"], "seed": spec["seed"], "error": err,
                                       "log": str(Path(spec_path).with_suffix("").with_suffix(".log")), "wall_s": 0})
            return 1
    import torch

    torch.set_num_threads(1)
    if spec["kind"] == "base":
        return _build_base(spec)
    marks: list[float] = []

    def log(msg: str) -> None:
        if ": done in " in msg:
            marks.append(time.time())
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    try:
        home = Path(spec["home"])
        shutil.rmtree(home, ignore_errors=True)  # an unfinished earlier attempt starts over
        (home / "checkpoints").mkdir(parents=True)
        shutil.copytree(spec["base"], home / "checkpoints" / "round-000000")
        from prodrl_pipelines.lab.demo import run_loop

        rows = run_loop(home, spec["settings"], spec["rounds"], log=log)
        boot = (marks[0] - t0) if marks else None
        result = {
            "recipe": spec["recipe"], "seed": spec["seed"], "status": "ok", "settings": spec["settings"],
            "wall_s": round(time.time() - t0, 2), "cpu_s": round(_cpu_seconds(), 2),
            "round_wall_s": [round(b - a, 2) for a, b in zip([t0] + marks, marks)][1:] if marks else [],
            "first_round_incl_bootstrap_s": round(boot, 2) if boot is not None else None,
            "rounds": [{k: r.get(k) for k in ("round", "heldout_reward", "heldout_reward_ci", "gate_passed",
                                               "deployed", "mismatch_abs_logp", "num_trajectories",
                                               "policy_version", "mlflow_run_id")} for r in rows],
            "retokenize": _retokenize_counts(home),
            "home": str(home),
        }
        write_json_atomic(Path(spec["result"]), result)
        return 0
    except BaseException as e:  # noqa: BLE001 - recorded, the runner goes on
        traceback.print_exc()
        write_json_atomic(failed, {"recipe": spec["recipe"], "seed": spec["seed"],
                                   "error": f"{type(e).__name__}: {e}".strip()[:2000],
                                   "log": str(Path(spec_path).with_suffix("").with_suffix(".log")),
                                   "wall_s": round(time.time() - t0, 2)})
        return 1


def _cpu_seconds() -> float:
    """CPU time of this process and its children (user + system): the run's cost on idle cores."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _build_base(spec: dict) -> int:
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.resources.settings import ProdRLSettings

    lab = ProdRLSettings(**spec["settings"]).settings().lab
    out = Path(spec["out"])
    tmp = out / ".round-000000.build"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    build_base_policy(tmp, progress=False, **lab.model_dump())  # LabSettings fields = builder kwargs
    os.replace(tmp, out / "round-000000")
    print(f"base policy {lab.model_dump()} built in {time.time() - t0:.0f}s ({_cpu_seconds():.0f} CPU s)", flush=True)
    return 0


def _retokenize_counts(home: Path) -> dict:
    """Summed ``retokenized_*`` counts from the runs' ``recorded_trajectories`` materializations (empty
    for recorded replay), read from this run's own Dagster instance (DAGSTER_HOME set by run_loop)."""
    try:
        from dagster import AssetKey, DagsterInstance

        inst = DagsterInstance.get()
        tot: dict[str, int] = {}
        for ev in inst.fetch_materializations(AssetKey("recorded_trajectories"), limit=10_000).records:
            md = ev.asset_materialization.metadata if ev.asset_materialization else {}
            for k, v in md.items():
                if k.startswith("retokenized_"):
                    val = getattr(v, "value", v)
                    if isinstance(val, (int, float)):
                        tot[k] = tot.get(k, 0) + int(val)
        return tot
    except Exception as e:  # diagnostics only
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    # the "_worker" marker stays in the command line so a run subprocess is easy to find (ps, the tests)
    if len(sys.argv) == 3 and sys.argv[1] == "_worker":
        sys.exit(run_spec(sys.argv[2]))
    print("usage: prodrl lab ablate --config FILE (this module's own entry point is for its workers)", file=sys.stderr)
    sys.exit(2)
