"""Dagster resources: thin typed wrappers that build the core objects (validated at run start)."""


import os

from dagster import ConfigurableResource, InitResourceContext
from pydantic import PrivateAttr

from prodrl_pipelines.rl.config import Recipe
from prodrl_pipelines.rounds import Services
from prodrl_pipelines.settings import DeploySettings, EvalSettings, LabSettings, Settings
from prodrl_pipelines.tracking import Lineage

_R, _D, _E = Recipe.model_fields, DeploySettings.model_fields, EvalSettings.model_fields


class ProdRLSettings(ConfigurableResource):
    """The loop's recipe, serving parameters, gate and paths (defaults: DESIGN.md)."""

    home: str = ".prodrl"
    # recipe (DESIGN.md s.4)
    steps_per_round: int = _R["steps_per_round"].default
    batch_size: int = _R["batch_size"].default
    learning_rate: float = _R["learning_rate"].default
    correction: str = _R["correction"].default
    baseline: str = _R["baseline"].default
    normalize_adv_std: bool = _R["normalize_adv_std"].default
    kl_beta: float = _R["kl_beta"].default
    tis_cap: float = _R["tis_cap"].default
    ppo_eps: float = _R["ppo_eps"].default
    cis_lambda: float = _R["cis_lambda"].default
    cis_kappa: float = _R["cis_kappa"].default
    icepop_low: float = _R["icepop_low"].default
    icepop_high: float = _R["icepop_high"].default
    max_policy_lag: int = _R["max_policy_lag"].default
    replay: str = _R["replay"].default  # "recorded" | "retokenized" (lab baseline, DESIGN.md s.5)
    seed: int = _R["seed"].default
    # serving (recorded with each call)
    temperature: float = _D["temperature"].default
    top_p: float = _D["top_p"].default
    top_k: int = _D["top_k"].default
    max_tokens: int = _D["max_tokens"].default
    num_top_logprobs: int = _D["num_top_logprobs"].default
    record_extra_draw: bool = _D["record_extra_draw"].default
    export_scheme: str = _D["export_scheme"].default  # "nvfp4-w4a16" | "nvfp4-w4a4" | "bf16"
    # held-out evaluation and gate
    heldout_size: int = _E["heldout_size"].default
    gate_tolerance: float = _E["gate_tolerance"].default
    gate_z: float = _E["gate_z"].default
    # laboratory
    lab_size: str = "demo"
    lab_seed: int = 0
    lab_sft_steps: int = -1  # -1: the lab size's default
    lab_task: str = "arithmetic"  # "arithmetic" | "chess" (chess needs max_tokens >= 48)
    # execution: >1 launches torchrun with this many ranks through Dagster Pipes
    train_processes: int = 1

    def fields(self) -> dict:
        """Plain field values (to hand the same settings to a subprocess)."""
        return {k: getattr(self, k) for k in type(self).model_fields}

    def settings(self) -> Settings:
        """Validate into the core settings; a bad value fails here, naming the setting."""
        return Settings(
            home=self.home,
            recipe=Recipe(
                steps_per_round=self.steps_per_round, batch_size=self.batch_size, learning_rate=self.learning_rate,
                correction=self.correction, baseline=self.baseline, normalize_adv_std=self.normalize_adv_std,
                kl_beta=self.kl_beta, max_policy_lag=self.max_policy_lag, seed=self.seed, tis_cap=self.tis_cap,
                ppo_eps=self.ppo_eps, cis_lambda=self.cis_lambda, cis_kappa=self.cis_kappa,
                icepop_low=self.icepop_low, icepop_high=self.icepop_high, replay=self.replay,
            ),
            deploy=DeploySettings(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  max_tokens=self.max_tokens, num_top_logprobs=self.num_top_logprobs,
                                  record_extra_draw=self.record_extra_draw, export_scheme=self.export_scheme),
            eval=EvalSettings(heldout_size=self.heldout_size, gate_tolerance=self.gate_tolerance, gate_z=self.gate_z),
            lab=LabSettings(size=self.lab_size, seed=self.lab_seed,
                            sft_steps=None if self.lab_sft_steps < 0 else self.lab_sft_steps, task=self.lab_task),
        )

    def setup_for_execution(self, context: InitResourceContext) -> None:
        self.settings()  # fail before any asset runs


class MlflowResource(ConfigurableResource):
    """A thin resource over MlflowClient (through the core `Lineage`)."""

    tracking_uri: str = ""  # empty: sqlite under the settings home
    experiment: str = "prodrl"
    model_name: str = "prodrl-policy"
    artifact_location: str = ""
    _lineage: Lineage | None = PrivateAttr(default=None)

    def lineage(self, settings: Settings) -> Lineage:
        if self._lineage is None:
            settings.home_path.mkdir(parents=True, exist_ok=True)
            uri = self.tracking_uri or settings.mlflow_uri
            # a tracking server stores artifacts where it is configured to (e.g. S3); a local
            # SQLite store keeps them under the settings home
            default_artifacts = None if uri.startswith("http") else settings.mlflow_artifacts
            self._lineage = Lineage(uri, self.experiment, self.model_name,
                                    artifact_location=self.artifact_location or default_artifacts)
        return self._lineage


class StoreResource(ConfigurableResource):
    """Where trajectories, rewards, round documents, checkpoints and exports live.

    Local directories by default; with ``s3_bucket`` set, everything goes to
    ``s3://<s3_bucket>/<s3_prefix>/`` with the same key layout (checkpoints under ``checkpoints/``,
    exports under ``exports/``). Credentials come from the boto3 default chain (env, profile, role).
    """

    root: str = ""  # local: empty means <home>/store
    s3_bucket: str = ""  # empty: local directories
    s3_prefix: str = ""
    s3_endpoint_url: str = ""  # empty: AWS; else an S3-compatible server (MinIO, moto, ...)
    s3_region: str = ""  # empty: the boto3 default (AWS_REGION / profile), else us-east-1

    @property
    def on_s3(self) -> bool:
        return bool(self.s3_bucket)

    def blobs(self, settings: Settings):
        if self.on_s3:
            from prodrl_pipelines.trajectories.s3 import S3BlobStore

            return S3BlobStore(self.s3_bucket, self.s3_prefix, endpoint_url=self.s3_endpoint_url or None,
                               region=self.s3_region or None)
        from prodrl_pipelines.trajectories.blobstore import LocalBlobStore

        return LocalBlobStore(self.root or settings.store_root)

    def checkpoint_store(self, settings: Settings, kind: str = "checkpoints"):
        """``kind`` "checkpoints" (trained) or "exports" (deployable): a ``CheckpointStore``."""
        from prodrl_pipelines.checkpoints import LocalCheckpointStore, S3CheckpointStore

        if kind not in ("checkpoints", "exports"):
            raise ValueError(f"kind must be 'checkpoints' or 'exports', got {kind!r}")
        if self.on_s3:
            return S3CheckpointStore(self.blobs(settings), kind)
        return LocalCheckpointStore(settings.checkpoints_root if kind == "checkpoints" else settings.exports_root)


def services(settings: ProdRLSettings, store: StoreResource, mlflow: MlflowResource | None = None) -> Services:
    s = settings.settings()
    return Services(settings=s, blobs=store.blobs(s), lineage=mlflow.lineage(s) if mlflow is not None else None,
                    exports_store=store.checkpoint_store(s, "exports") if store.on_s3 else None,
                    checkpoints_store=store.checkpoint_store(s, "checkpoints") if store.on_s3 else None)


def make_resources(settings: dict, store_root: str = "", tracking_uri: str = "", s3: dict | None = None) -> dict:
    """Resources from plain values; ``settings`` holds ProdRLSettings fields (validated here);
    ``s3`` optional StoreResource S3 fields (s3_bucket, s3_prefix, s3_endpoint_url, s3_region)."""
    from dagster import PipesSubprocessClient

    res = {
        "settings": ProdRLSettings(**settings),
        "store": StoreResource(root=store_root, **(s3 or {})),
        "mlflow": MlflowResource(tracking_uri=tracking_uri),
        "pipes": PipesSubprocessClient(),
    }
    res["settings"].settings()  # a bad setting fails at load time, naming the field
    return res


def default_resources() -> dict:
    """Resources from the environment: PRODRL_HOME (default ./.prodrl), PRODRL_SETTINGS_JSON (a JSON
    object of ProdRLSettings fields), PRODRL_STORE_ROOT, MLFLOW_TRACKING_URI, and for S3
    PRODRL_S3_BUCKET / PRODRL_S3_PREFIX / PRODRL_S3_ENDPOINT_URL / PRODRL_S3_REGION."""
    import json

    overrides = json.loads(os.environ.get("PRODRL_SETTINGS_JSON", "{}") or "{}")
    overrides.setdefault("home", os.environ.get("PRODRL_HOME", ".prodrl"))
    s3 = {f"s3_{k}": os.environ.get(f"PRODRL_S3_{k.upper()}", "") for k in ("bucket", "prefix", "endpoint_url", "region")}
    return make_resources(overrides, os.environ.get("PRODRL_STORE_ROOT", ""),
                          os.environ.get("MLFLOW_TRACKING_URI", ""), s3)
