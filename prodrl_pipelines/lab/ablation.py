"""Ablation runner: the prod-RL loop for several recipes x seeds, aggregated into a report.

``prodrl lab ablate --config ablations/default.yaml`` (README "Ablations"):

1. **Config** (:class:`AblationConfig`, YAML): ``name``, ``rounds``, ``seeds``, ``base`` settings
   (flat ``ProdRLSettings`` fields), ``recipes`` (name -> overrides of ``base``), ``comparisons``
   (named groups of recipes plotted together), ``claims`` (statements the report checks against the
   measured table) and the ``collapse`` rule. Everything is validated before any work starts: every
   recipe's merged settings go through ``ProdRLSettings(...).settings()``, and a bad key or value
   fails naming the recipe.
2. **Seeds**: seed ``k`` sets both ``seed`` (minibatch order, sampling) and ``lab_seed`` (tokenizer-free
   parts of the base policy: init weights, SFT data), so each seed is a different base policy too.
   All recipes of one seed start from the *same* base policy (the comparison is paired by seed).
3. **Runner**: every (recipe, seed) runs ``lab.demo.run_loop`` in its own subprocess with its own home
   ``runs/<name>/runs/<recipe>/seed<k>/`` (SQLite Dagster instance, MLflow SQLite, stores), in-process
   deterministic lab traffic (``PRODRL_LAB_TRAFFIC=in_process``) and one torch thread; ``--workers``
   subprocesses run at a time. The round-0 SFT checkpoint depends only on the lab settings, so it is
   built once per distinct lab configuration (``runs/<name>/bases/``) and copied into each run's home,
   whose own bootstrap then only exports, evaluates and registers it (measured: SFT is ~60 of the
   ~75 s a bootstrap takes on one core). A finished run writes ``result.json`` atomically and is
   skipped on a rerun; a failed run writes ``failed.json`` (error, log path) and the others go on; a
   rerun retries failed and unfinished runs from scratch.
4. **Aggregation** (:func:`aggregate`): per recipe, over seeds: final / best / mean-over-rounds held-out
   reward, the sd of the final reward across seeds, collapsed seeds (:class:`CollapseRule`), gate
   failures, mean engine mismatch.
5. **Report**: ``runs/<name>/report.md`` (table, claims, plots), ``results.csv`` / ``results.json``,
   ``plots/*.png``, logged to MLflow as one run of experiment ``ablation/<name>`` (tracking URI
   ``MLFLOW_TRACKING_URI`` or ``sqlite:///runs/<name>/mlflow.db``).

Test hook: ``PRODRL_ABLATION_FAIL_RECIPES=a,b`` makes the workers of those recipes fail at start (the
tests use it to exercise failed-run handling with a real subprocess).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

FAIL_ENV = "PRODRL_ABLATION_FAIL_RECIPES"
SEED_KEYS = ("seed", "lab_seed")  # settings a seed sets; a config may not set them itself
RESERVED_KEYS = SEED_KEYS + ("home",)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# ``--quick``: shrink any config to a smoke test (tiny lab policy, few steps, one seed, <= 2 rounds).
QUICK_OVERRIDES: dict[str, Any] = {
    "lab_size": "tiny", "lab_sft_steps": 10, "steps_per_round": 2, "batch_size": 8, "heldout_size": 16,
}
QUICK_ROUNDS = 2

# env of a worker: its own SQLite Dagster home and MLflow, one thread, deterministic in-process traffic
_CHILD_ENV_DROP = ("PRODRL_DAGSTER_HOME", "DAGSTER_PG_URL", "DAGSTER_HOME", "MLFLOW_TRACKING_URI", "PRODRL_HOME",
                   "PRODRL_SETTINGS_JSON", "PRODRL_STORE_ROOT", "PRODRL_S3_BUCKET", "PRODRL_S3_PREFIX",
                   "PRODRL_S3_ENDPOINT_URL", "PRODRL_S3_REGION")
_CHILD_ENV_SET = {"PRODRL_LAB_TRAFFIC": "in_process", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "PRODRL_THREADS_PER_RANK": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
                  "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "PYTHONUNBUFFERED": "1"}


# ============================================================================ config
class CollapseRule(BaseModel):
    """A seed's run *collapsed* when its final held-out reward is below its base (round-0) reward by
    more than ``below_base``, or below its own best round by more than ``drop_from_best``."""

    model_config = ConfigDict(extra="forbid")
    below_base: float = Field(0.05, ge=0)
    drop_from_best: float = Field(0.10, ge=0)

    def collapsed(self, rewards: list[float]) -> bool:
        """``rewards[0]`` = base, ``rewards[-1]`` = final (NaNs ignored)."""
        ys = [y for y in rewards if y is not None and math.isfinite(y)]
        if len(ys) < 2:
            return False
        base, final, best = ys[0], ys[-1], max(ys[1:])
        return final < base - self.below_base or final < best - self.drop_from_best


METRICS = ("final_mean", "final_sd", "best_mean", "worst_mean", "auc_mean", "base_mean", "gain_mean", "gain_sd",
           "jitter_mean", "collapsed",
           "gate_failures", "mismatch_mean")


class Claim(BaseModel):
    """``lhs.metric  op  rhs.metric (+ margin)``, e.g. final_sd of the KL recipe < that without KL."""

    model_config = ConfigDict(extra="forbid")
    text: str
    lhs: str
    op: Literal[">", ">=", "<", "<="]
    rhs: str
    metric: Literal[METRICS] = "final_mean"  # type: ignore[valid-type]
    margin: float = 0.0  # lhs op rhs + margin (e.g. ">=" with margin -0.02: "at least matches, within 0.02")


class AblationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    rounds: int = Field(ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    base: dict[str, Any] = Field(default_factory=dict)
    recipes: dict[str, dict[str, Any]] = Field(min_length=1)
    comparisons: dict[str, list[str]] = Field(default_factory=dict)
    claims: list[Claim] = Field(default_factory=list)
    collapse: CollapseRule = CollapseRule()

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"name {v!r} must match {_NAME_RE.pattern} (it names a directory)")
        return v

    @field_validator("seeds")
    @classmethod
    def _seeds_unique(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"seeds must be distinct, got {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "AblationConfig":
        from prodrl_pipelines.resources.settings import ProdRLSettings

        known = set(ProdRLSettings.model_fields)
        for where, d in [("base", self.base)] + [(f"recipe {r!r}", o or {}) for r, o in self.recipes.items()]:
            bad = sorted(set(d) - known)
            if bad:
                raise ValueError(f"{where}: unknown setting(s) {bad} (not ProdRLSettings fields)")
            res = sorted(set(d) & set(RESERVED_KEYS))
            if res:
                raise ValueError(f"{where}: {res} are set by the runner (seeds -> seed and lab_seed; home per run)")
        for r in self.recipes:
            if not _NAME_RE.match(r):
                raise ValueError(f"recipe name {r!r} must match {_NAME_RE.pattern} (it names a directory)")
            try:
                s = self.settings_for(r, self.seeds[0])
                from prodrl_pipelines.lab.warmstart import SFT_DEFAULTS

                if s.get("lab_size", "demo") not in SFT_DEFAULTS:  # else only the base build would notice
                    raise ValueError(f"lab_size: {s['lab_size']!r} is not one of {sorted(SFT_DEFAULTS)}")
            except (ValidationError, ValueError, TypeError) as e:
                raise ValueError(f"recipe {r!r}: invalid settings: {_short_error(e)}") from None
        for c, members in self.comparisons.items():
            unknown = [m for m in members if m not in self.recipes]
            if unknown:
                raise ValueError(f"comparison {c!r}: unknown recipe(s) {unknown}; recipes are {sorted(self.recipes)}")
            if not members:
                raise ValueError(f"comparison {c!r} lists no recipes")
        for cl in self.claims:
            for side in (cl.lhs, cl.rhs):
                if side not in self.recipes:
                    raise ValueError(f"claim {cl.text!r}: unknown recipe {side!r}; recipes are {sorted(self.recipes)}")
        return self

    def settings_for(self, recipe: str, seed: int) -> dict:
        """The flat settings of one run, validated (raises naming the field)."""
        from prodrl_pipelines.resources.settings import ProdRLSettings

        s = {**self.base, **(self.recipes[recipe] or {}), "seed": int(seed), "lab_seed": int(seed)}
        ProdRLSettings(**s).settings()
        return s

    def quick(self) -> "AblationConfig":
        """A smoke-test version of this config: tiny sizes, the first seed, at most 2 rounds."""
        d = self.model_dump()
        d.update(rounds=min(self.rounds, QUICK_ROUNDS), seeds=self.seeds[:1],
                 base={**self.base, **QUICK_OVERRIDES})
        return AblationConfig(**d)


def _short_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'settings'}: {err['msg']}" for err in e.errors())
    return str(e)


def load_config(path: str | Path, *, quick: bool = False, name: str | None = None,
                seeds: list[int] | None = None, recipes: list[str] | None = None,
                rounds: int | None = None) -> AblationConfig:
    """Read and validate a YAML config; CLI overrides applied before validation of the result."""
    import yaml

    p = Path(path)
    if not p.exists():
        raise AblationConfigError(f"config {p} does not exist")
    raw = yaml.safe_load(p.read_text()) or {}
    if not isinstance(raw, dict):
        raise AblationConfigError(f"config {p}: expected a mapping at top level")
    if name:
        raw["name"] = name
    if seeds:
        raw["seeds"] = list(seeds)
    if rounds:
        raw["rounds"] = int(rounds)
    if recipes:
        missing = [r for r in recipes if r not in (raw.get("recipes") or {})]
        if missing:
            raise AblationConfigError(f"config {p}: --recipes {missing} not in the config's recipes")
        raw["recipes"] = {r: raw["recipes"][r] for r in recipes}
        kept = {c: [m for m in ms if m in recipes] for c, ms in (raw.get("comparisons") or {}).items()}
        # a comparison survives when it still compares something (or lost nothing)
        raw["comparisons"] = {c: ms for c, ms in kept.items()
                              if len(ms) >= 2 or (ms and len(ms) == len(raw["comparisons"][c]))}
        raw["claims"] = [c for c in raw.get("claims") or [] if c.get("lhs") in recipes and c.get("rhs") in recipes]
    try:
        cfg = AblationConfig(**raw)
        if quick:
            cfg = cfg.quick()
            if not name:
                cfg = AblationConfig(**{**cfg.model_dump(), "name": f"{cfg.name}-quick"})
    except ValidationError as e:
        raise AblationConfigError(f"config {p}: {_short_error(e)}") from None
    return cfg


class AblationConfigError(ValueError):
    pass


# ============================================================================ runner
def _atomic_write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _lab_key(settings: dict) -> str:
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
    """Run every (recipe, seed) not finished yet; returns what happened. Never raises for a failed run."""
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
            bkey = _lab_key(settings)
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
    t.proc = subprocess.Popen([sys.executable, "-m", "prodrl_pipelines.lab.ablation", "_worker", str(spec_path)],
                              stdout=t.logf, stderr=subprocess.STDOUT, env=_child_env(), cwd=os.getcwd())


def _record_failure(t: Task, error: str, out: Outcome) -> None:
    out.failed += 1
    _atomic_write_json(Path(t.spec["failed"]), {"recipe": t.recipe, "seed": t.seed, "error": error, "log": str(t.log)})


# ---------------------------------------------------------------------------- worker (subprocess)
def _worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.time()
    if spec["kind"] == "run":
        failed = Path(spec["failed"])
        failed.unlink(missing_ok=True)
        if spec["recipe"] in [r for r in os.environ.get(FAIL_ENV, "").split(",") if r]:
            err = f"RuntimeError: injected failure for recipe {spec['recipe']!r} ({FAIL_ENV})"
            print(err, flush=True)
            _atomic_write_json(failed, {"recipe": spec["recipe"], "seed": spec["seed"], "error": err,
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
        _atomic_write_json(Path(spec["result"]), result)
        return 0
    except BaseException as e:  # noqa: BLE001 - recorded, the runner goes on
        traceback.print_exc()
        _atomic_write_json(failed, {"recipe": spec["recipe"], "seed": spec["seed"],
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


# ============================================================================ aggregation
def _finite(xs) -> list[float]:
    return [float(x) for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]


def _mean(xs) -> float:
    xs = _finite(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _sd(xs) -> float:
    """Sample standard deviation (ddof=1); NaN for fewer than 2 values."""
    xs = _finite(xs)
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def curve(result: dict) -> list[float]:
    """Held-out reward per round (index = round; round 0 = base); NaN where missing."""
    n = max((r["round"] for r in result["rounds"]), default=-1) + 1
    ys = [float("nan")] * n
    for r in result["rounds"]:
        y = r.get("heldout_reward")
        ys[r["round"]] = float(y) if y is not None else float("nan")
    return ys


def aggregate(cfg: AblationConfig, results: list[dict], failures: list[dict] | None = None) -> dict[str, dict]:
    """Per recipe: the table row (see module docstring). ``results`` = result.json documents.

    final = reward at the last round; best / worst = max / min over rounds >= 1; auc = mean over rounds
    >= 1; gain = final - base; sd = sample sd across seeds (ddof=1) -- ``gain_sd`` is the spread across
    seeds net of the base policies' own spread (each seed has its own base); jitter = mean over rounds
    t >= 2 of abs(reward_t - reward_{t-1}) (round-to-round volatility), averaged over seeds;
    collapsed = seeds meeting ``cfg.collapse``; gate_failures = rounds whose gate failed (all seeds);
    mismatch = mean over rounds and seeds of |log pi_k - log mu|.
    """
    failures = failures or []
    table: dict[str, dict] = {}
    for recipe in cfg.recipes:
        rs = sorted([r for r in results if r["recipe"] == recipe], key=lambda r: r["seed"])
        curves = [curve(r) for r in rs]
        finals = [c[-1] for c in curves]
        bases = [c[0] for c in curves]
        bests = [max(_finite(c[1:]), default=float("nan")) for c in curves]
        aucs = [_mean(c[1:]) for c in curves]
        worsts = [min(_finite(c[1:]), default=float("nan")) for c in curves]
        jitters = [_mean([abs(c[i] - c[i - 1]) for i in range(2, len(c))]) for c in curves]
        gates = sum(1 for r in rs for x in r["rounds"] if x["round"] > 0 and x.get("gate_passed") is False)
        mism = [x.get("mismatch_abs_logp") for r in rs for x in r["rounds"] if x["round"] > 0]
        table[recipe] = {
            "recipe": recipe, "seeds_ok": len(rs),
            "seeds_failed": sum(1 for f in failures if f["recipe"] == recipe and not f.get("missing")),
            "seeds_missing": sum(1 for f in failures if f["recipe"] == recipe and f.get("missing")),
            "seeds": [r["seed"] for r in rs],
            "base_mean": _mean(bases), "final_mean": _mean(finals), "final_sd": _sd(finals),
            "final_min": min(_finite(finals), default=float("nan")),
            "final_max": max(_finite(finals), default=float("nan")),
            "best_mean": _mean(bests), "worst_mean": _mean(worsts), "auc_mean": _mean(aucs),
            "gain_mean": _mean([f - b for f, b in zip(finals, bases)]),
            "gain_sd": _sd([f - b for f, b in zip(finals, bases)]), "jitter_mean": _mean(jitters),
            "collapsed": sum(1 for c in curves if cfg.collapse.collapsed(c)),
            "gate_failures": gates, "mismatch_mean": _mean(mism),
            "wall_s_mean": _mean([r.get("wall_s") for r in rs]), "cpu_s_mean": _mean([r.get("cpu_s") for r in rs]),
            **{f"retokenized_{k}": sum(int(r.get("retokenize", {}).get(f"retokenized_{k}", 0) or 0) for r in rs)
               for k in ("calls_differ", "calls", "multi_turn_calls", "multi_turn_calls_differ", "tokens_differ")},
        }
    return table


def check_claims(cfg: AblationConfig, table: dict[str, dict]) -> list[dict]:
    """Evaluate each claim on the table: ``holds`` True/False, or None when a side has no data."""
    ops = {">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}
    out = []
    for c in cfg.claims:
        a, b = table[c.lhs][c.metric], table[c.rhs][c.metric]
        ok = None if not (math.isfinite(a) and math.isfinite(b)) else bool(ops[c.op](a, b + c.margin))
        out.append({"text": c.text, "lhs": c.lhs, "rhs": c.rhs, "metric": c.metric, "op": c.op,
                    "margin": c.margin, "lhs_value": a, "rhs_value": b, "holds": ok})
    return out


def paired_diffs(results: list[dict], a: str, b: str) -> list[float]:
    """Per seed (both recipes finished): final reward of ``a`` minus that of ``b`` (same base policy)."""
    fa = {r["seed"]: curve(r)[-1] for r in results if r["recipe"] == a}
    fb = {r["seed"]: curve(r)[-1] for r in results if r["recipe"] == b}
    return [fa[s] - fb[s] for s in sorted(set(fa) & set(fb))]


def identical_pairs(cfg: AblationConfig, results: list[dict], tol: float = 1e-9) -> list[tuple[str, str, int]]:
    """Pairs of recipes of a comparison whose curves coincide on every seed both finished (>= 1 seed)."""
    by = {(r["recipe"], r["seed"]): curve(r) for r in results}
    out, seen = [], set()
    for members in cfg.comparisons.values():
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if (a, b) in seen:
                    continue
                seen.add((a, b))
                shared = [s for s in cfg.seeds if (a, s) in by and (b, s) in by]
                if shared and all(len(by[a, s]) == len(by[b, s]) and all(
                        abs(x - y) <= tol for x, y in zip(by[a, s], by[b, s])) for s in shared):
                    out.append((a, b, len(shared)))
    return out


# ============================================================================ report
def load_results(cfg: AblationConfig, root: Path) -> tuple[list[dict], list[dict]]:
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


def _f(x, nd=3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


TABLE_COLUMNS = ["recipe", "seeds", "base", "final mean ± sd", "best mean", "worst mean", "mean rounds>=1",
                 "sd(gain)", "jitter", "collapsed", "gate failures", "engine mismatch", "min/run (CPU)"]


def table_rows(table: dict[str, dict]) -> list[list[str]]:
    rows = []
    for r in table.values():
        extra = [f"+{r['seeds_failed']} failed"] * bool(r["seeds_failed"]) + \
            [f"+{r.get('seeds_missing', 0)} not run"] * bool(r.get("seeds_missing"))
        seeds = f"{r['seeds_ok']}" + (f" ({', '.join(extra)})" if extra else "")
        rows.append([r["recipe"], seeds, _f(r["base_mean"]), f"{_f(r['final_mean'])} ± {_f(r['final_sd'])}",
                     _f(r["best_mean"]), _f(r["worst_mean"]), _f(r["auc_mean"]), _f(r["gain_sd"]),
                     _f(r["jitter_mean"]),
                     f"{r['collapsed']}/{r['seeds_ok']}",
                     str(r["gate_failures"]), _f(r["mismatch_mean"], 4),
                     f"{_f(r['wall_s_mean'] / 60, 1)} ({_f(r['cpu_s_mean'] / 60, 1)})"])
    return rows


def write_report(cfg: AblationConfig, root: Path, results: list[dict], failures: list[dict],
                 wall_s: float | None = None) -> dict:
    """report.md, results.csv, results.json and plots/ under ``root``; returns paths and the table."""
    from prodrl_pipelines.lab.ablation_plots import comparison_png, finals_png

    root = Path(root)
    table = aggregate(cfg, results, failures)
    claims = check_claims(cfg, table)
    plots = root / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    curves = {rec: {r["seed"]: curve(r) for r in results if r["recipe"] == rec} for rec in cfg.recipes}
    plot_files: dict[str, Path] = {}
    groups = dict(cfg.comparisons) or {"all recipes": list(cfg.recipes)}
    for cname, members in groups.items():
        fn = plots / f"{_slug(cname)}.png"
        fn.write_bytes(comparison_png({m: curves[m] for m in members}, title=f"{cname}: held-out reward"))
        plot_files[cname] = fn
    mism = {rec: {r["seed"]: [x.get("mismatch_abs_logp") if x.get("mismatch_abs_logp") is not None else float("nan")
                              for x in sorted(r["rounds"], key=lambda x: x["round"])]
                  for r in results if r["recipe"] == rec} for rec in cfg.recipes}
    mm = plots / "engine_mismatch.png"
    mm.write_bytes(comparison_png(mism, title="engine mismatch mean |log pi_k - log mu| per round",
                                  ylabel="|log pi_k - log mu|"))
    fin = plots / "final_reward_by_recipe.png"
    fin.write_bytes(finals_png({m: [c[-1] for c in curves[m].values()] for m in cfg.recipes},
                               {m: [c[0] for c in curves[m].values()] for m in cfg.recipes}))

    # results.csv: one row per (recipe, seed, round)
    with open(root / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["recipe", "seed", "round", "heldout_reward", "heldout_reward_ci", "gate_passed", "deployed",
                    "mismatch_abs_logp"])
        for r in sorted(results, key=lambda r: (r["recipe"], r["seed"])):
            for x in r["rounds"]:
                w.writerow([r["recipe"], r["seed"], x["round"], x.get("heldout_reward"), x.get("heldout_reward_ci"),
                            x.get("gate_passed"), x.get("deployed"), x.get("mismatch_abs_logp")])
    doc = {"name": cfg.name, "config": cfg.model_dump(), "table": table, "claims": claims, "failures": failures,
           "runs": [{k: r.get(k) for k in ("recipe", "seed", "wall_s", "cpu_s", "round_wall_s", "rounds", "retokenize")}
                    for r in results],
           "wall_s": wall_s}
    _atomic_write_json(root / "results.json", doc)

    L = [f"# Ablation `{cfg.name}`", ""]
    L.append(f"{len(cfg.recipes)} recipes x {len(cfg.seeds)} seed(s) {cfg.seeds}, {cfg.rounds} rounds each; "
             f"{len(results)} runs finished, {sum(not f.get('missing') for f in failures)} failed, "
             f"{sum(bool(f.get('missing')) for f in failures)} not run"
             + (f"; runner wall time {wall_s / 60:.1f} min." if wall_s else "."))
    L.append("")
    L.append("Base settings: `" + json.dumps(cfg.base, sort_keys=True) + "`. Seed k sets `seed` and `lab_seed` "
             "(every recipe of a seed starts from the same base policy). Held-out reward = the candidate's "
             "mean reward on the held-out tasks after each round (round 0 = base policy), whether or not "
             "the gate deployed it.")
    L += ["", "## Results", ""]
    L.append("| " + " | ".join(TABLE_COLUMNS) + " |")
    L.append("|" + "---|" * len(TABLE_COLUMNS))
    for row in table_rows(table):
        L.append("| " + " | ".join(row) + " |")
    L += ["", f"final = held-out reward after round {cfg.rounds}; best / worst = max / min over rounds "
          f"1..{cfg.rounds} (per seed, then averaged); sd = sample sd across seeds; sd(gain) = sd across seeds "
          "of final - base (the spread net of each seed's own base policy); jitter = mean abs change of the "
          "reward between consecutive rounds from round 2 on (plateau stability), averaged over seeds; "
          "collapsed: final < base - "
          f"{cfg.collapse.below_base} or final < best - {cfg.collapse.drop_from_best} (per seed); gate failures: "
          "rounds whose candidate the gate refused (all seeds); engine mismatch = mean over rounds and seeds of "
          "mean abs(log pi_k - log mu) on the round's data; min/run = wall minutes per run (CPU minutes).", ""]
    L += ["## Recipes", ""]
    for rec, ov in cfg.recipes.items():
        L.append(f"- `{rec}`: `{json.dumps(ov or {}, sort_keys=True)}`")
    if claims:
        L += ["", "## Claims, checked on these numbers", ""]
        for c in claims:
            verdict = {True: "**holds**", False: "**does not hold**", None: "**no data**"}[c["holds"]]
            diffs = paired_diffs(results, c["lhs"], c["rhs"]) if c["metric"] in ("final_mean", "gain_mean") else []
            extra = (f"; per-seed final differences {c['lhs']} - {c['rhs']}: "
                     + ", ".join(f"{d:+.3f}" for d in diffs)) if diffs else ""
            m = f" {c['margin']:+g}" if c["margin"] else ""
            L.append(f"- {c['text']}: {verdict} — {c['metric']} `{c['lhs']}` {_f(c['lhs_value'])} {c['op']} "
                     f"`{c['rhs']}` {_f(c['rhs_value'])}{m}{extra}")
    same = identical_pairs(cfg, results)
    if same:
        L += ["", "Identical held-out curves (equal to 1e-9 at every round of every seed both finished, so "
              "these settings did not change the measured outcome here): "
              + "; ".join(f"`{a}` = `{b}` ({n} seed{'s' if n > 1 else ''})" for a, b, n in same) + "."]
    retok = {k: v for k, v in table.items() if v["retokenized_calls"]}
    if retok:
        L += ["", "Retokenized replay: " + "; ".join(
            f"`{k}` rebuilt {v['retokenized_calls_differ']} of {v['retokenized_calls']} calls with ids different "
            f"from the recorded ones ({v['retokenized_multi_turn_calls_differ']} of "
            f"{v['retokenized_multi_turn_calls']} multi-turn calls; "
            f"{v['retokenized_tokens_differ'] / max(v['retokenized_calls_differ'], 1):.1f} differing tokens per "
            "differing call)" for k, v in retok.items())
            + (" — the lab's tokenizer round-trips its own outputs exactly, so retokenization changes nothing "
               "here and the curves coincide." if all(v["retokenized_calls_differ"] == 0 for v in retok.values())
               else ".")]
    L += ["", "## Plots", "", "Mean over seeds (thick line), min-max band over seeds (shaded), each seed (thin).", ""]
    for cname, fn in plot_files.items():
        L.append(f"### {cname}\n\n![{cname}](plots/{fn.name})\n")
    L.append(f"### final held-out reward by recipe\n\n![final](plots/{fin.name})\n")
    L.append(f"### engine mismatch by recipe\n\n![mismatch](plots/{mm.name})\n")
    if failures:
        L += ["## Failed or missing runs", ""]
        for f in failures:
            L.append(f"- `{f['recipe']}` seed {f['seed']}: {str(f.get('error', '')).splitlines()[0][:300]}"
                     + (f" (log: `{f['log']}`)" if f.get("log") else ""))
        L.append("")
    L += ["## Runs", "", "Each run's home (Dagster SQLite instance, MLflow, stores, checkpoints) is "
          "`runs/<recipe>/seed<k>/home`; its log `runs/<recipe>/seed<k>/run.log`; per-round numbers in "
          "`results.csv`.", ""]
    (root / "report.md").write_text("\n".join(L) + "\n")
    return {"report": root / "report.md", "csv": root / "results.csv", "json": root / "results.json",
            "plots": sorted(plots.glob("*.png")), "table": table, "claims": claims}


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_").lower() or "plot"


def log_to_mlflow(cfg: AblationConfig, root: Path, rep: dict, tracking_uri: str | None = None) -> tuple[str, str]:
    """One MLflow run in experiment ``ablation/<name>``: params, per-recipe metrics (and mean curves
    as step metrics), the report, plots, CSV/JSON as artifacts. Returns (tracking_uri, run_id)."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=uri)
    exp_name = f"ablation/{cfg.name}"
    exp = client.get_experiment_by_name(exp_name)
    if exp is None:
        art = None if uri.startswith("http") else (root / "mlartifacts").resolve().as_uri()
        exp_id = client.create_experiment(exp_name, artifact_location=art)
    else:
        exp_id = exp.experiment_id
    run = client.create_run(exp_id, run_name=cfg.name, tags={"prodrl.ablation": cfg.name})
    rid = run.info.run_id
    params = [Param("rounds", str(cfg.rounds)), Param("seeds", json.dumps(cfg.seeds)),
              Param("recipes", ",".join(cfg.recipes)), Param("base", json.dumps(cfg.base, sort_keys=True)[:6000])]
    params += [Param(f"recipe.{k}", json.dumps(v or {}, sort_keys=True)[:6000]) for k, v in cfg.recipes.items()]
    client.log_batch(rid, params=params)
    ts = int(time.time() * 1000)
    ms = []
    for rec, row in rep["table"].items():
        for k in METRICS:
            v = row[k]
            if isinstance(v, (int, float)) and math.isfinite(v):
                ms.append(Metric(f"{rec}.{k}", float(v), ts, 0))
    res = json.loads(rep["json"].read_text())["runs"]
    for rec in cfg.recipes:
        cs = [curve(r) for r in res if r["recipe"] == rec]
        for i in range(max((len(c) for c in cs), default=0)):
            m = _mean([c[i] for c in cs if i < len(c)])
            if math.isfinite(m):
                ms.append(Metric(f"{rec}.heldout_reward_mean", m, ts, i))
    for i in range(0, len(ms), 900):
        client.log_batch(rid, metrics=ms[i:i + 900])
    for p in [rep["report"], rep["csv"], rep["json"], root / "config.json"]:
        if not p.exists():
            continue
        client.log_artifact(rid, str(p))
    for p in rep["plots"]:
        client.log_artifact(rid, str(p), artifact_path="plots")
    client.set_terminated(rid)
    return uri, rid


# ============================================================================ CLI
def add_ablate_parser(lab_sub) -> None:
    a = lab_sub.add_parser("ablate", help="run the pipeline for several recipes x seeds; report + plots")
    a.add_argument("--config", required=True, help="YAML ablation config (e.g. ablations/default.yaml)")
    a.add_argument("--name", help="override the config's name (results under <runs-dir>/<name>/)")
    a.add_argument("--quick", action="store_true",
                   help="smoke test: tiny lab policy and sizes, first seed only, at most 2 rounds")
    a.add_argument("--workers", type=int, default=2, help="concurrent run subprocesses (one torch thread each)")
    a.add_argument("--seeds", type=int, nargs="+", help="override the config's seeds")
    a.add_argument("--recipes", nargs="+", help="run only these recipes of the config")
    a.add_argument("--rounds", type=int, help="override the config's rounds (use a new --name: finished runs "
                                              "are skipped whatever their rounds)")
    a.add_argument("--runs-dir", default="runs")
    a.add_argument("--no-mlflow", action="store_true", help="do not log the report to MLflow")
    a.set_defaults(fn=cmd_ablate)


def _terminate_runs_on_sigterm() -> None:
    """`kill` of the runner (not only Ctrl-C) must stop its run subprocesses too: a run left behind
    would race the rerun that restarts it in the same home. SIGTERM becomes SystemExit, which
    `run_ablation`'s cleanup handles like KeyboardInterrupt (terminate, then kill, the workers)."""
    import signal

    def _exit(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def cmd_ablate(args) -> int:
    try:
        cfg = load_config(args.config, quick=args.quick, name=args.name, seeds=args.seeds, recipes=args.recipes,
                          rounds=args.rounds)
    except AblationConfigError as e:
        print(f"prodrl lab ablate: {e}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("prodrl lab ablate: --workers must be >= 1", file=sys.stderr)
        return 2
    root = (Path(args.runs_dir) / cfg.name).resolve()
    t0 = time.time()
    _terminate_runs_on_sigterm()
    out = run_ablation(cfg, root, workers=args.workers, progress=sys.stderr.isatty())
    wall = time.time() - t0
    results, failures = load_results(cfg, root)
    rep = write_report(cfg, root, results, failures, wall_s=wall if out.ran else None)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ablation {cfg.name}")
    for c in TABLE_COLUMNS:
        t.add_column(c)
    for row in table_rows(rep["table"]):
        t.add_row(*row)
    Console(width=180).print(t)
    for c in rep["claims"]:
        print(f"  {'HOLDS' if c['holds'] else ('NO DATA' if c['holds'] is None else 'DOES NOT HOLD')}: {c['text']}")
    if not args.no_mlflow:
        uri, rid = log_to_mlflow(cfg, root, rep)
        print(f"MLflow: run {rid} in experiment ablation/{cfg.name} ({uri})")
    print(f"{out.ran} ran, {out.skipped} skipped (already done), {out.failed} failed in {wall / 60:.1f} min; "
          f"report: {rep['report']}")
    return 0 if not failures else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_worker":
        sys.exit(_worker(sys.argv[2]))
    print("usage: prodrl lab ablate --config FILE (this module's own entry point is for its workers)", file=sys.stderr)
    sys.exit(2)
