"""Everything a prod-RL loop is configured with, typed and validated before any work starts."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prodrl_pipelines.cluster.config import CLUSTER_FIELDS
from prodrl_pipelines.config import environment
from prodrl_pipelines.engines.types import SamplingParams
from prodrl_pipelines.evaluation.monitor_config import MonitorSettings
from prodrl_pipelines.observability.config import ObservabilitySettings
from prodrl_pipelines.rewards.config import RewardSettings
from prodrl_pipelines.rl.config import Recipe, registered
from prodrl_pipelines.trajectories.data_config import DataSettings


# parity probe bounds (mean, p99 of |log mu_new - log pi_trainer| in nats) per export scheme
PROBE_BOUNDS = {"bf16": (0.05, 0.5), "nvfp4-w4a16": (0.05, 0.5), "nvfp4-w4a4": (0.5, 5.0)}


class DeploySettings(BaseModel):
    """Sampling parameters the deployment serves with (recorded with every call)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(8, ge=1)
    num_top_logprobs: int = Field(8, ge=1, le=20)
    record_extra_draw: bool = False
    # MoE: record the experts the deployment routed every position to (the local engine's own forward;
    # managed servers started with --enable-return-routed-experts), for routing replay
    # (recipe.routing_replay) and the per-round routing diagnostics. Off by default: it costs a blob per
    # call (bandwidth on a large MoE) and one extra forward per round for the diagnostics
    record_routing: bool = False
    # what the deployment serves: NVFP4 weights (W4A16 data-free, W4A4 calibrated) or bf16
    export_scheme: Literal["nvfp4-w4a16", "nvfp4-w4a4", "bf16"] = "nvfp4-w4a16"
    # how an export becomes live (deploy_targets.TARGETS): pointer | prodrl-serve | vllm-restart |
    # vllm-reload | vllm-weight-transfer (GPU only) | vllm-lora | prodrl-serve-lora (a LoRA round's
    # adapter loaded into the running servers) | command
    target: str = "pointer"
    # auto: a candidate that passes the gate is deployed; review: it becomes `challenger` with
    # review=pending and waits for a reviewer in the MLflow registry (or `prodrl review`)
    promotion: Literal["auto", "review"] = "auto"
    target_port: int = Field(8000, ge=1, le=65534, description="managed servers: replica i uses this port + 2i "
                                                              "and the next (blue/green); a canary the pair after them")
    # a fleet behind one address (managed targets: prodrl-serve, vllm-restart), updated in waves of at
    # most max_unavailable replicas, each new replica healthy and probed before its old one drains
    replicas: int = Field(1, ge=1, le=32)
    max_unavailable: int = Field(1, ge=1)
    # where a managed target's replica servers run: local child processes, or each owned by a detached
    # Ray actor in a placement group of replica_cpus / replica_gpus on the cluster at cluster_address
    # (deploy_targets/ray_placement.py); ray needs cluster: ray (checked in settings_from_flat)
    replica_placement: Literal["local", "ray"] = "local"
    replica_cpus: float = Field(1.0, gt=0, description="replica_placement ray: CPUs each replica reserves")
    replica_gpus: float = Field(0.0, ge=0, description="replica_placement ray: GPUs each replica reserves")
    replica_spread: bool = Field(False, description="replica_placement ray: at most one replica per node")
    drain_timeout_s: float = Field(300.0, gt=0, description=(
        "a replaced server gets SIGTERM once no new call goes to it and finishes the calls it accepted "
        "(long streams included) for up to this long before SIGKILL"))
    export_fetch_timeout_s: float = Field(3600.0, gt=0, description=(
        "replica_placement ray: how long a node may take to fetch the export from the store before its "
        "server starts (a call of its own: large exports are not bound by the server's start)"))
    # a canary between "gate passed" (and review approved) and "live": this fraction of trajectories
    # (sticky per trajectory id) goes to the candidate until canary_min_trajectories of them are
    # rewarded, then its live reward is compared with the champion's on the same window (0: no canary)
    canary_fraction: float = Field(0.0, ge=0, lt=1)
    canary_min_trajectories: int = Field(64, ge=2)
    canary_scoring_budget_s: float = Field(120.0, gt=0, description=(
        "how long one canary scoring run (requested by the canary sensor, one at a time) may score the "
        "canary window, a judge included; no judge attempt runs past it and what is left is scored by the "
        "next run (the sensor's tick never scores: it judges what is recorded)"))
    canary_scoring_every_s: float = Field(60.0, ge=0, description=(
        "the canary sensor requests a scoring run of the canary window at most this often (one at a time)"))
    canary_pause_grace_s: float = Field(600.0, ge=0, description=(
        "a canary the recorder paused (its server refused connections) is failed only after this long "
        "paused; one whose server answers again meanwhile is resumed (a restart is not a bad model)"))
    endpoint_store: str = Field("", description=(
        "where the deployment's endpoint record lives: empty, the file home/deployment/endpoint.json "
        "(one host); a PostgreSQL URL, a row every host reads (the recorder, the sensors and the fleet "
        "keeper on hosts other than the deploy step's): deploy_targets/endpoint_store.py"))
    endpoint_name: str = Field("default", description="the endpoint record's name in endpoint_store")
    target_endpoint: str = Field("", description="vllm-reload, vllm-weight-transfer: a running dev-mode vLLM; "
                                                 "command: where it serves ({port} filled in)")
    # vllm-weight-transfer: where the server's workers reach this process (NCCL rank 0 of the transfer
    # group, its rendezvous store listens there); port 0: a free one
    weight_transfer_address: str = "127.0.0.1"
    weight_transfer_port: int = Field(0, ge=0, le=65535)
    target_command: str = Field("", description="command: template with {export_dir}, {policy_version}, {port}")
    vllm_python: str = Field("", description="vLLM's own interpreter (default $PRODRL_VLLM_PYTHON)")
    server_args: tuple[str, ...] = ()  # extra arguments of a managed server (vllm / prodrl serve)
    # the served model's reasoning and tool-call format (engines.reply_parsers.TOOL_FORMATS, e.g. qwen3):
    # managed servers parse replies into reasoning and tool_calls and serve tool_choice (prodrl serve
    # --reply-parser; vLLM --enable-auto-tool-choice --tool-call-parser --reasoning-parser); none: plain
    reply_parser: str = "none"
    # how the recorder in front of the deployment serves chat calls (recorder.chat_extend): rerender (the
    # client's history through the chat template) or extend (a session's calls as extensions of its
    # previous call's tokens: an agent's episode trains as one sequence; docs/agents.md)
    chat_history: Literal["rerender", "extend"] = "rerender"
    # the adapter targets (vllm-lora, prodrl-serve-lora): each server's --max-lora-rank (vLLM accepts
    # 1, 8, 16, 32, 64, 128, 256, 320, 512), and how many adapters each keeps loaded (the one served
    # and those before it, for a rollback that only routes back); older ones are unloaded
    lora_max_rank: int = 16
    lora_kept_adapters: int = Field(2, ge=1, le=16)
    health_timeout_s: float = Field(300.0, gt=0)
    # the parity probe after every deploy: recorded prompts through the new deployment, the sampled
    # tokens' |log mu_new - log pi_trainer| against these bounds (probe_prompts = 0: no probe)
    probe_prompts: int = Field(16, ge=0)
    # None: the export scheme's own bound (PROBE_BOUNDS: W4A4's activation quantization is the
    # deployment's and costs the lab's demo model ~0.2 nats mean; vLLM's bf16 kernels ~0.005)
    probe_mean_bound: float | None = Field(None, gt=0)
    probe_p99_bound: float | None = Field(None, gt=0)

    def probe_bounds(self) -> tuple[float, float]:
        mean, p99 = PROBE_BOUNDS[self.export_scheme]
        return (self.probe_mean_bound or mean, self.probe_p99_bound or p99)

    @model_validator(mode="after")
    def _head_covers_top_k(self) -> "DeploySettings":
        if self.top_k and self.num_top_logprobs < self.top_k:
            raise ValueError(f"num_top_logprobs ({self.num_top_logprobs}) must be >= top_k ({self.top_k}) so the "
                             "recorded head holds the whole sampling support")
        return self

    @field_validator("target")
    @classmethod
    def _known_target(cls, v: str) -> str:
        from prodrl_pipelines.deploy_targets import TARGETS

        return registered(v, TARGETS, "deploy target")

    @field_validator("lora_max_rank")
    @classmethod
    def _vllm_lora_rank(cls, v: int) -> int:
        from prodrl_pipelines.deploy_targets.adapters import VLLM_LORA_RANKS

        if v not in VLLM_LORA_RANKS:
            raise ValueError(f"lora_max_rank {v}: the servers' --max-lora-rank takes one of {list(VLLM_LORA_RANKS)}")
        return v

    @field_validator("reply_parser")
    @classmethod
    def _known_reply_parser(cls, v: str) -> str:
        from prodrl_pipelines.engines.reply_parsers import reply_parser_flags

        reply_parser_flags(v, vllm=True)  # an unknown name fails naming the valid ones
        return v

    @model_validator(mode="after")
    def _endpoint_store(self) -> "DeploySettings":
        from prodrl_pipelines.deploy_targets.endpoint_store import check_endpoint_store

        check_endpoint_store(self.endpoint_store, self.endpoint_name)
        return self

    @field_validator("target_command")
    @classmethod
    def _command_template(cls, v: str) -> str:
        from prodrl_pipelines.deploy_targets.command import check_command_template

        check_command_template(v)
        return v

    @model_validator(mode="after")
    def _fleet_fits_the_target(self) -> "DeploySettings":
        from prodrl_pipelines.deploy_targets import ADAPTER_TARGETS, FLEET_TARGETS

        if self.max_unavailable > self.replicas:
            raise ValueError(f"max_unavailable ({self.max_unavailable}) must be <= replicas ({self.replicas})")
        if (self.replicas > 1 or self.canary_fraction > 0) and self.target not in FLEET_TARGETS:
            raise ValueError(f"replicas > 1 and canary_fraction need a managed target ({', '.join(FLEET_TARGETS)}); "
                             f"target {self.target!r} runs one server it does not manage")
        if self.replica_placement == "ray" and self.target not in FLEET_TARGETS:
            raise ValueError(f"replica_placement 'ray' needs a managed target ({', '.join(FLEET_TARGETS)}); "
                             f"target {self.target!r} starts no server of its own")
        if self.replica_placement == "ray" and self.target in ADAPTER_TARGETS:
            raise ValueError(f"replica_placement 'ray' with the adapter target {self.target!r} is not built yet: "
                             "place its servers locally (replica_placement 'local')")
        if self.replica_spread and self.replica_placement != "ray":
            raise ValueError("replica_spread places replicas on distinct Ray nodes: it needs replica_placement 'ray'")
        return self

    @model_validator(mode="after")
    def _command_needs_template(self) -> "DeploySettings":
        if self.target == "command" and not self.target_command:
            raise ValueError("deploy target 'command' needs target_command")
        return self

    @model_validator(mode="after")
    def _weight_transfer_needs_endpoint(self) -> "DeploySettings":
        if self.target == "vllm-weight-transfer" and not self.target_endpoint.startswith(("http://", "https://")):
            raise ValueError("deploy target 'vllm-weight-transfer' needs target_endpoint: the http(s) URL of a running "
                             "vLLM started in dev mode with --weight-transfer-config '{\"backend\": \"nccl\"}'")
        return self

    def sampling(self, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.max_tokens,
                              self.num_top_logprobs, tuple(stop_token_ids), self.record_extra_draw,
                              self.record_routing)


class EvalSettings(BaseModel):
    """The held-out evaluation and the gate. ``suite``: ``lab`` (the lab task), ``lab:NAME``, a JSONL
    file (local or s3://) with ``reward_fn`` = ``package.module:function``, or ``package.module:Suite``
    (see ``evaluation.loading``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    suite: str = "lab"
    reward_fn: str = ""
    # live monitoring through the serving endpoint (OpenAI-compatible, e.g. vLLM); empty: the local engine
    live_endpoint: str = ""
    heldout_size: int = Field(256, ge=2)
    eval_seed: int = 1234
    # episodes played together in one engine batch (0: every held-out task in one batch). Part of what
    # the evaluation samples (batch b is seeded from eval_seed and b): the same value gives the same
    # episodes in-process and sharded over Ray workers, which play whole batches
    episode_batch: int = Field(0, ge=0)
    gate_tolerance: float = Field(0.05, ge=0)
    gate_z: float = Field(1.645, gt=0, description="one-sided 95% paired bound")


class LabSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    size: str = "demo"
    seed: int = 0
    sft_steps: int | None = None
    # a lab task environment registered by the lab (lab/tasks.py: arithmetic, chess, arithmetic_tools);
    # the lab checks the name when it loads its suite or model (check_settings, before any work)
    task: str = "arithmetic"
    # the warm start's demonstrator hedges this often ("12 13"; arithmetic only): the habit a grader
    # with a hole rewards (the reward-hacking walkthrough)
    hedge_noise: float = Field(0.0, ge=0, le=1)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    home: str = environment.DEFAULT_HOME
    # round 0: a Hugging Face model directory, an s3:// URI, or a registered source ("lab": the lab's toy model)
    base_model: str = "lab"
    recipe: Recipe = Recipe()
    deploy: DeploySettings = DeploySettings()
    eval: EvalSettings = EvalSettings()
    rewards: RewardSettings = RewardSettings()
    monitors: MonitorSettings = MonitorSettings()
    lab: LabSettings = LabSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    data: DataSettings = DataSettings()

    @model_validator(mode="after")
    def _sampled_needs_extra_draw(self) -> "Settings":
        if self.recipe.correction == "score_centering_sampled" and not self.deploy.record_extra_draw:
            raise ValueError("correction 'score_centering_sampled' needs deploy.record_extra_draw = true "
                             "(the deployment must record an extra draw per position)")
        return self

    @model_validator(mode="after")
    def _adapter_fits_the_servers(self) -> "Settings":
        from prodrl_pipelines.deploy_targets import ADAPTER_TARGETS

        if self.recipe.training == "lora" and self.deploy.target in ADAPTER_TARGETS \
                and self.recipe.lora_rank > self.deploy.lora_max_rank:
            raise ValueError(f"recipe.lora_rank {self.recipe.lora_rank} > deploy.lora_max_rank {self.deploy.lora_max_rank}: "
                             f"the {self.deploy.target} servers (--max-lora-rank) could not load the adapters")
        return self

    @property
    def home_path(self) -> Path:
        return Path(self.home).resolve()

    @property
    def store_root(self) -> Path:
        return self.home_path / "store"

    @property
    def checkpoints_root(self) -> Path:
        return self.home_path / "checkpoints"

    @property
    def exports_root(self) -> Path:
        return self.home_path / "exports"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.home_path / 'mlflow.db'}"

    @property
    def mlflow_artifacts(self) -> str:
        return (self.home_path / "mlartifacts").as_uri()


def check_settings(settings: Settings, s3_endpoint_url: str | None = None):
    """What can fail before any work starts beyond field types: the evaluation suite loads and fits
    the serving settings (e.g. a task whose answers need more ``max_tokens``), the reward sources
    build (the grader imports), and a canary can be judged (its new traffic can be rewarded).
    Returns the suite."""
    from prodrl_pipelines.evaluation import load_suite
    from prodrl_pipelines.rewards.scoring import RewardPlan

    plan = RewardPlan(settings.rewards)  # the grader imports, the judge's settings hold together
    stuck = plan.cannot_reward_new_traffic() if settings.deploy.canary_fraction > 0 else None
    if stuck:  # the canary is judged on the plan's rewards of its own, new traffic: it would run forever
        raise ValueError(f"canary_fraction {settings.deploy.canary_fraction}: the canary can never be judged: {stuck}; "
                         f"unpin rewards_versions, add a source that rewards new traffic, or set canary_fraction 0")
    return load_suite(settings.eval.suite, settings.eval.reward_fn, settings, s3_endpoint_url)


class SettingsFileError(ValueError):
    """A settings file cannot be read; the message names the file."""


def load_settings_file(path: str | Path) -> dict:
    """Flat settings from a JSON or YAML file. A relative ``home`` resolves against the file's directory
    (a copied settings file never writes into the original's home), and so do relative local paths
    of ``base_model`` and ``eval_suite``; a file without ``home`` leaves it to ``PRODRL_HOME``
    (default ``./.prodrl``)."""
    import json

    p = Path(path)
    if not p.is_file():
        raise SettingsFileError(f"settings file {str(path)!r} does not exist")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - JSON and YAML errors alike
        raise SettingsFileError(f"settings file {str(path)!r} does not parse: {e}") from None
    if not isinstance(data, dict):
        raise SettingsFileError(f"settings file {str(path)!r} must hold an object of settings fields, "
                                f"got {type(data).__name__}")
    here = p.resolve().parent
    home = data.get("home")
    if isinstance(home, str) and home and not Path(home).expanduser().is_absolute():
        data["home"] = str((here / home).resolve())
    elif home is None:
        data["home"] = environment.default_home()
    from prodrl_pipelines.evaluation.loading import registered_sources

    sources = registered_sources()
    for key in ("base_model", "eval_suite"):  # local paths (not s3://, not a source name) are relative to the file
        v = data.get(key)
        if (isinstance(v, str) and "://" not in v and not Path(v).expanduser().is_absolute()
                and (key != "eval_suite" or v.partition(":")[0] not in sources)
                and ("/" in v or v.endswith(".jsonl"))):
            data[key] = str((here / v).resolve())
    return data


# --- flat names: one namespace for the Dagster resource, settings files, PRODRL_SETTINGS_JSON -------
# Each field of a section is reachable by one flat name, derived here (never re-declared): recipe and
# deploy fields by their own names, eval fields as eval_<name> (the gate's historic names stay bare),
# lab fields as lab_<name>; home and base_model at the top.
SECTIONS = {"recipe": Recipe, "deploy": DeploySettings, "eval": EvalSettings, "rewards": RewardSettings,
            "monitors": MonitorSettings, "lab": LabSettings, "observability": ObservabilitySettings,
            "data": DataSettings}
_EVAL_BARE = {"heldout_size", "gate_tolerance", "gate_z", "eval_seed"}
TOP_FIELDS = ("home", "base_model")


def _flat_name(section: str, name: str) -> str:
    if section in ("recipe", "deploy") or (section == "eval" and name in _EVAL_BARE):
        return name
    return f"{section}_{name}"


@lru_cache(maxsize=None)
def flat_fields() -> dict[str, tuple[str | None, str]]:
    """Flat name -> (section or None for top-level fields, field name)."""
    out: dict[str, tuple[str | None, str]] = {name: (None, name) for name in TOP_FIELDS}
    for section, model in SECTIONS.items():
        for name in model.model_fields:
            flat = _flat_name(section, name)
            if flat in out:
                raise AssertionError(f"flat settings name {flat!r} is ambiguous")
            out[flat] = (section, name)
    return out


def field_info(flat: str):
    section, name = flat_fields()[flat]
    return (Settings if section is None else SECTIONS[section]).model_fields[name]


# how the orchestrator runs a step, not what the round computes: settable beside the core settings
# (settings files, the Dagster resource), never part of ``Settings``
# (``cluster.config``: where the heavy steps run, local or on Ray)
EXECUTION_FIELDS = ("train_processes", *CLUSTER_FIELDS)


def settings_from_flat(flat: dict) -> Settings:
    """Core settings from flat names; an unknown name fails naming it (and the valid ones).
    Execution fields (``EXECUTION_FIELDS``) are accepted and left out."""
    table = flat_fields()
    nested: dict = {}
    for key, value in flat.items():
        if key in EXECUTION_FIELDS:
            continue
        if key not in table:
            raise ValueError(f"unknown setting {key!r}; valid settings: {', '.join(sorted(table))}")
        section, name = table[key]
        if section is None:
            nested[name] = value
        else:
            nested.setdefault(section, {})[name] = value
    from pydantic import ValidationError

    try:
        settings = Settings(**nested)
        check_replica_placement(settings, flat)
        return settings
    except ValidationError as e:  # report the flat names the user wrote, not the nested location
        flat_of = {v: k for k, v in table.items()}
        problems = []
        for err in e.errors():
            loc = tuple(str(x) for x in err["loc"])
            where = (flat_of.get((loc[0], loc[1])) if len(loc) >= 2 else flat_of.get((None, loc[0])) if loc else None)
            msg = err["msg"].removeprefix("Value error, ")
            where = where or '.'.join(loc) or 'settings'
            problems.append(msg if msg.startswith(f"{where}_") else f"{where}: {msg}")
        raise ValueError("; ".join(problems)) from None


def check_replica_placement(settings: Settings, flat: dict) -> None:
    """``replica_placement: ray`` places the fleet on the cluster the execution settings name: it needs
    ``cluster: ray`` and its ``cluster_address``; fails naming the fields."""
    if settings.deploy.replica_placement != "ray":
        return
    from prodrl_pipelines.cluster.config import cluster_settings

    if not cluster_settings(flat).on_ray:
        raise ValueError("replica_placement: 'ray' places the replicas on a Ray cluster: set cluster 'ray' and "
                         "cluster_address (the Ray dashboard URL, e.g. http://127.0.0.1:8265)")
