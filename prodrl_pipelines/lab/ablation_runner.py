"""Running an ablation: every (recipe, seed) of an :class:`AblationConfig` in its own worker subprocess
(:mod:`prodrl_pipelines.lab.ablation_worker`) under ``<root>/runs/<recipe>/seed<k>/``, a few at a time,
each shared round-0 base policy built first; finished runs are skipped on a rerun, and
:func:`load_results` reads back what the runs left."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prodrl_pipelines.lab.ablation_config import AblationConfig
from prodrl_pipelines.storage.atomic import write_json_atomic

# run by name, not imported: the worker imports the lab demo, which registers the ablate command
WORKER_MODULE = "prodrl_pipelines.lab.ablation_worker"

# env of a worker: its own SQLite Dagster home and MLflow, one thread, deterministic in-process traffic
_CHILD_ENV_DROP = ("PRODRL_DAGSTER_HOME", "DAGSTER_PG_URL", "DAGSTER_HOME", "MLFLOW_TRACKING_URI", "PRODRL_HOME",
                   "PRODRL_SETTINGS_JSON", "PRODRL_STORE_ROOT", "PRODRL_S3_BUCKET", "PRODRL_S3_PREFIX",
                   "PRODRL_S3_ENDPOINT_URL", "PRODRL_S3_REGION")
_CHILD_ENV_SET = {"PRODRL_LAB_TRAFFIC": "in_process", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "PRODRL_THREADS_PER_RANK": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
                  "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "PYTHONUNBUFFERED": "1"}


def base_policy_key(settings: dict) -> str:
    """The base checkpoint depends only on the lab settings (LabSettings: size, seed, sft_steps, task)."""
    from prodrl_pipelines.resources.settings import ProdRLSettings

    lab = ProdRLSettings(**settings).settings().lab.model_dump()
    h = hashlib.sha1(json.dumps(lab, sort_keys=True).encode()).hexdigest()[:8]
    return f"lab-seed{lab['seed']}-{h}"


@dataclass
class Task:
    kind: str  # "base" | "run"
    key: str  # base: lab key; run: "<recipe>/seed<k>"
    spec: dict
    log: Path
    recipe: str = ""
    seed: int = 0
    base_key: str = ""
    proc: subprocess.Popen | None = None
    started: float = 0.0
    logf: Any = None


@dataclass
class Outcome:
    ran: int = 0
    skipped: int = 0
    failed: int = 0
    results: list[dict] = field(default_factory=list)


def run_dir(root: Path, recipe: str, seed: int) -> Path:
    return root / "runs" / recipe / f"seed{seed}"


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CHILD_ENV_DROP}
    env.update(_CHILD_ENV_SET)
    return env


def run_ablation(cfg: AblationConfig, root: Path, workers: int = 2, log=print, progress: bool = True) -> Outcome:
    """Run every (recipe, seed) not finished yet; returns what happened. Never raises for a failed run.

    Each run has its own home ``runs/<recipe>/seed<k>/home`` (SQLite Dagster instance, MLflow SQLite,
    stores), in-process deterministic lab traffic and one torch thread; ``workers`` subprocesses run at
    a time. The round-0 SFT checkpoint depends only on the lab settings, so it is built once per
    distinct lab configuration (``bases/``) and copied into each run's home, whose own bootstrap then
    only exports, evaluates and registers it (measured: SFT is ~60 of the ~75 s a bootstrap takes on
    one core). A finished run writes ``result.json`` atomically and is skipped on a rerun; a failed run
    writes ``failed.json`` (error, log path) and the others go on; a rerun retries failed and
    unfinished runs from scratch.
    """
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(cfg.model_dump_json(indent=1))
    out = Outcome()
    bases: dict[str, Task] = {}
    runs: list[Task] = []
    for seed in cfg.seeds:
        for recipe in cfg.recipes:
            d = run_dir(root, recipe, seed)
            settings = cfg.settings_for(recipe, seed)
            if (d / "result.json").exists():
                old = json.loads((d / "result.json").read_text())
                if old.get("settings") == settings and len(old.get("rounds", [])) == cfg.rounds + 1:
                    out.skipped += 1
                    continue
                os.replace(d / "result.json", d / "result.stale.json")
                log(f"{recipe}/seed{seed}: result.json was made with other settings or rounds -> running again "
                    "(old one kept as result.stale.json)")
            bkey = base_policy_key(settings)
            bdir = root / "bases" / bkey
            if bkey not in bases and not (bdir / "round-000000" / "config.json").exists():
                bases[bkey] = Task("base", bkey, {"kind": "base", "out": str(bdir), "settings": settings},
                                   root / "bases" / f"{bkey}.log")
            runs.append(Task("run", f"{recipe}/seed{seed}",
                             {"kind": "run", "home": str(d / "home"), "result": str(d / "result.json"),
                              "failed": str(d / "failed.json"), "base": str(bdir / "round-000000"),
                              "settings": settings, "rounds": cfg.rounds, "recipe": recipe, "seed": seed},
                             d / "run.log", recipe=recipe, seed=seed, base_key=bkey))
    if out.skipped:
        log(f"{out.skipped} run(s) already finished (result.json) -> skipped")
    if not runs:
        return out
    log(f"running {len(runs)} run(s) ({len(bases)} base polic{'y' if len(bases) == 1 else 'ies'} to build first) "
        f"on {workers} worker(s); logs under {root}/runs/<recipe>/seed<k>/run.log")
    from tqdm.auto import tqdm

    bar = tqdm(total=len(runs), desc=f"ablation {cfg.name}", unit="run", disable=not progress, dynamic_ncols=True)
    base_state: dict[str, str | None] = {k: None for k in bases}  # None pending, "ok", or an error
    pending_bases = list(bases.values())
    pending_runs = list(runs)
    running: list[Task] = []
    t_start, n_done = time.time(), 0
    try:
        while pending_bases or pending_runs or running:
            # fill free slots: bases first, then runs whose base is ready
            while len(running) < workers:
                t = None
                if pending_bases:
                    t = pending_bases.pop(0)
                else:
                    for i, r in enumerate(pending_runs):
                        st = base_state.get(r.base_key, "ok")
                        if st is None:
                            continue
                        t = pending_runs.pop(i)
                        if st != "ok":
                            _record_failure(t, f"base policy {r.base_key} failed: {st}", out)
                            bar.update(1)
                            n_done += 1
                            log(f"FAILED {t.key}: base policy failed ({st})")
                            t = "skip"
                        break
                if t is None:
                    break
                if t == "skip":
                    continue
                _start(t)
                running.append(t)
            time.sleep(0.2)
            for t in list(running):
                rc = t.proc.poll()
                if rc is None:
                    continue
                running.remove(t)
                t.logf.close()
                dt = time.time() - t.started
                if t.kind == "base":
                    ok = rc == 0 and (Path(t.spec["out"]) / "round-000000" / "config.json").exists()
                    base_state[t.key] = "ok" if ok else f"exit code {rc}, see {t.log}"
                    log(f"base policy {t.key}: {'ready' if ok else 'FAILED'} in {dt:.0f}s")
                    continue
                res_path = Path(t.spec["result"])
                if rc == 0 and res_path.exists():
                    res = json.loads(res_path.read_text())
                    out.ran += 1
                    out.results.append(res)
                    rw = [r["heldout_reward"] for r in res["rounds"]]
                    msg = f"{t.key}: {rw[0]:.3f} -> {rw[-1]:.3f} (best {max(rw):.3f}) in {dt:.0f}s"
                else:
                    failed = Path(t.spec["failed"])
                    if not failed.exists():
                        _record_failure(t, f"worker exited with code {rc} without a result", out)
                    else:
                        out.failed += 1
                    msg = f"FAILED {t.key} (exit {rc}): see {t.log}"
                bar.update(1)
                n_done += 1
                done, el = n_done, time.time() - t_start
                eta = el / done * (len(runs) - done) if done else float("nan")
                msg = f"[{done}/{len(runs)} runs, {el / 60:.1f} min, ETA ~{eta / 60:.0f} min] {msg}"
                log(msg) if not progress else bar.write(msg)
    except BaseException:
        for t in running:  # our own children only
            if t.proc and t.proc.poll() is None:
                t.proc.terminate()
        for t in running:
            try:
                t.proc.wait(timeout=10)
            except Exception:
                t.proc.kill()
        raise
    finally:
        bar.close()
    return out


def _start(t: Task) -> None:
    t.log.parent.mkdir(parents=True, exist_ok=True)
    spec_path = t.log.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(t.spec, indent=1))
    t.logf = open(t.log, "w")
    t.started = time.time()
    t.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, "_worker", str(spec_path)],
                              stdout=t.logf, stderr=subprocess.STDOUT, env=_child_env(), cwd=os.getcwd())


def _record_failure(t: Task, error: str, out: Outcome) -> None:
    out.failed += 1
    write_json_atomic(Path(t.spec["failed"]), {"recipe": t.recipe, "seed": t.seed, "error": error, "log": str(t.log)})


def load_results(cfg: AblationConfig, root: Path) -> tuple[list[dict], list[dict]]:
    """The ``result.json`` documents of the finished runs, and a failure entry for every other run
    (its ``failed.json``, or ``missing: True`` when it never ran)."""
    results, failures = [], []
    for seed in cfg.seeds:
        for recipe in cfg.recipes:
            d = run_dir(root, recipe, seed)
            if (d / "result.json").exists():
                results.append(json.loads((d / "result.json").read_text()))
            elif (d / "failed.json").exists():
                failures.append(json.loads((d / "failed.json").read_text()))
            else:
                failures.append({"recipe": recipe, "seed": seed, "error": "not run yet (no result.json)", "log": "",
                                 "missing": True})
    return results, failures
