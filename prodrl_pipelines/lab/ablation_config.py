"""An ablation's YAML config (``prodrl lab ablate --config``): ``name``, ``rounds``, ``seeds``, ``base``
settings (flat ``ProdRLSettings`` fields), ``recipes`` (name -> overrides of ``base``), ``comparisons``
(named groups of recipes plotted together), ``claims`` (statements the report checks against the
measured table) and the ``collapse`` rule, all validated before any work starts."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SEED_KEYS = ("seed", "lab_seed")  # settings a seed sets; a config may not set them itself
RESERVED_KEYS = SEED_KEYS + ("home",)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# ``--quick``: shrink any config to a smoke test (tiny lab policy, few steps, one seed, <= 2 rounds).
QUICK_OVERRIDES: dict[str, Any] = {
    "lab_size": "tiny", "lab_sft_steps": 10, "steps_per_round": 2, "batch_size": 8, "heldout_size": 16,
}
QUICK_ROUNDS = 2


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


# the per-recipe numbers of the aggregated table a claim may compare (and MLflow logs)
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
        # every recipe's merged settings are validated here, so a bad key or value fails naming the
        # recipe before any run starts
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
        """The flat settings of one run, validated (raises naming the field).

        Seed ``k`` sets both ``seed`` (minibatch order, sampling) and ``lab_seed`` (tokenizer-free parts
        of the base policy: init weights, SFT data), so each seed is a different base policy too, and all
        recipes of one seed start from the *same* base policy (the comparison is paired by seed)."""
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
