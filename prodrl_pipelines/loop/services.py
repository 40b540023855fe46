"""What every round step works with: the settings, the stores, the lineage, and moving checkpoints
and exports between this machine and the object store."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from prodrl_pipelines.storage import documents
from prodrl_pipelines.storage.locations import StoreLocation
from prodrl_pipelines.storage.blobstore import BlobNotFoundError
from prodrl_pipelines.loop.ledger import RoundLedger, LiveDeployment
from prodrl_pipelines.loop.round_state import round_index
from prodrl_pipelines.config.settings import Settings
from prodrl_pipelines.loop.lineage import Lineage


class RoundError(RuntimeError):
    """A round cannot proceed; the message says which input or setting is at fault."""


@dataclass
class Services:
    settings: Settings
    blobs: object
    lineage: Lineage | None = None
    exports_store: object | None = None  # CheckpointStore where deployable exports are published
    checkpoints_store: object | None = None  # CheckpointStore where trained checkpoints are published
    episode_runner: object | None = None  # who plays held-out episodes (evaluation.runners); None: this process

    @property
    def ledger(self) -> RoundLedger:
        return RoundLedger(self.blobs)

    @property
    def s3_endpoint_url(self) -> str | None:
        return getattr(self.blobs, "endpoint_url", None)

    @property
    def suite(self):
        """The held-out evaluation suite of the settings (``eval.suite``), loaded once."""
        if getattr(self, "_suite", None) is None:
            from prodrl_pipelines.evaluation import load_suite

            self._suite = load_suite(self.settings.eval.suite, self.settings.eval.reward_fn, self.settings,
                                     self.s3_endpoint_url)
        return self._suite

    @property
    def rewards(self):
        """The reward sources of the settings (``rewards``) and how they combine, built once."""
        if getattr(self, "_rewards", None) is None:
            from prodrl_pipelines.rewards.scoring import RewardPlan

            self._rewards = RewardPlan(self.settings.rewards)
        return self._rewards

    @property
    def store(self):
        from prodrl_pipelines.trajectories.store import TrajectoryStore

        return TrajectoryStore(self.blobs)

    def live(self) -> LiveDeployment:
        live = self.ledger.live()
        if live is None:
            raise RoundError(
                "no live deployment: bootstrap the round-0 policy first (asset `base_policy` or `prodrl bootstrap`)"
            )
        # On a fresh machine (another pod, a restarted worker) the live policy comes from the stores.
        ensure_local(self, "checkpoints", live.policy_version, Path(live.checkpoint_dir))
        ensure_local(self, "exports", live.policy_version, Path(live.export_dir))
        if not (Path(live.checkpoint_dir) / "config.json").exists():
            raise RoundError(f"live checkpoint {live.policy_version} is missing at {live.checkpoint_dir}"
                             + ("" if self.checkpoints_store is None else f" and in {self.checkpoints_store!r}"))
        return live


def build_services(settings: Settings, store: StoreLocation, lineage: Lineage | None = None) -> Services:
    """The services of one home: its stores at ``store``, and ``lineage`` where the step records to MLflow."""
    return Services(settings=settings, blobs=store.blobs(settings), lineage=lineage,
                    exports_store=store.checkpoint_store(settings, "exports") if store.on_s3 else None,
                    checkpoints_store=store.checkpoint_store(settings, "checkpoints") if store.on_s3 else None)


def services_from_env(flat_settings: dict | None = None, *, with_lineage: bool = False,
                      check: bool = False) -> Services:
    """Services for a process outside Dagster (a CLI command, a torchrun rank, the stack): settings
    from ``flat_settings`` (default: ``PRODRL_SETTINGS_JSON``), stores and tracking server from the
    environment (``config.environment``). ``check`` loads the evaluation suite now, so a bad suite
    fails before any work (``config.settings.check_settings``)."""
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.config.settings import settings_from_flat
    from prodrl_pipelines.loop.lineage import open_lineage

    flat = dict(environment.read_settings() if flat_settings is None else flat_settings)
    settings = settings_from_flat(flat)
    lineage = open_lineage(settings, environment.tracking_uri()) if with_lineage else None
    svc = build_services(settings, StoreLocation(**environment.read_store()), lineage)
    if check:
        svc.suite  # noqa: B018 - loads (and validates) the suite against the settings
    return svc


def ensure_local(svc: Services, kind: str, name: str, local_dir: Path | None = None) -> Path:
    """The local directory of checkpoint/export ``name`` (``kind`` "checkpoints" | "exports").

    Local directories are the store itself. With an object store, a directory that is missing here
    is fetched (verified against its manifest) into its usual place, so every step can run on a
    machine that did not produce it; a name never published is left missing for the caller to report.
    """
    from prodrl_pipelines.storage.checkpoints import CheckpointNotFoundError

    s = svc.settings
    root = s.checkpoints_root if kind == "checkpoints" else s.exports_root
    local_dir = Path(local_dir) if local_dir is not None else root / name
    store = svc.checkpoints_store if kind == "checkpoints" else svc.exports_store
    if store is None or (local_dir / "config.json").exists():
        return _with_base(svc, kind, local_dir)
    try:
        got = store.fetch(name, local_dir.parent)
    except CheckpointNotFoundError:
        return local_dir
    if got != local_dir:  # fetched under its name; the registry recorded another directory name
        raise RoundError(f"{kind} {name} fetched to {got}, but the deployment expects it at {local_dir}")
    return _with_base(svc, kind, got)


def _with_base(svc: Services, kind: str, export_dir: Path) -> Path:
    """A LoRA round's export adapts another export (``quant.adapter_export``): that one comes too."""
    from prodrl_pipelines.quant.adapter_export import BASE_FILE

    if kind == "exports" and (export_dir / BASE_FILE).is_file():
        base_version = json.loads((export_dir / BASE_FILE).read_text()).get("base_version")
        if base_version and base_version != export_dir.name:
            ensure_local(svc, "exports", str(base_version))
    return export_dir


def publish_checkpoint(svc: Services, name: str, checkpoint_dir: Path) -> str:
    """Publish a trained checkpoint to the checkpoints store (a no-op for local directories)."""
    if svc.checkpoints_store is None:
        return Path(checkpoint_dir).resolve().as_uri()
    return svc.checkpoints_store.publish(Path(checkpoint_dir), name)


def publish_export(svc: Services, name: str, export_dir: Path) -> str:
    """Publish an export to the exports store; returns the URI a model version registers as its
    source (``s3://...`` on S3, ``file://...`` locally; MLflow servers refuse local paths)."""
    if svc.exports_store is None:
        return Path(export_dir).resolve().as_uri()
    return svc.exports_store.publish(Path(export_dir), name)


def round_seed(settings: Settings, rkey: str) -> int:
    return settings.recipe.seed * 1_000_003 + round_index(rkey)


def vocab_size(checkpoint_dir: str) -> int:
    return int(json.loads((Path(checkpoint_dir) / "config.json").read_text())["vocab_size"])


def moe_routing_shape(checkpoint_dir: str) -> tuple[int, int, int] | None:
    """(MoE layers, experts per token, experts) of a Qwen3-MoE-style config; None for a dense model.
    A layer is sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    experts, k = cfg.get("num_experts") or 0, cfg.get("num_experts_per_tok") or 0
    if not experts or not k:
        return None
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    layers = sum(1 for i in range(int(cfg["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)
    return layers, int(k), int(experts)


def upstream_json(svc: Services, key: str):
    """A round document written by an upstream step, or a RoundError saying which step to run."""
    try:
        return documents.get_json(svc.blobs, key)
    except BlobNotFoundError:
        raise RoundError(f"{key} is missing: materialise the upstream asset of this round first") from None


def upstream_table(svc: Services, key: str) -> pa.Table:
    """A round table written by an upstream step, or a RoundError saying which step to run."""
    try:
        return documents.get_table(svc.blobs, key)
    except BlobNotFoundError:
        raise RoundError(f"{key} is missing: materialise the upstream asset of this round first") from None


def reference_export(svc: Services, version: str, export_dir: Path, why: str = "") -> Path:
    """The deployed export of ``version``, the reference model of corrections that need one
    (``Recipe.needs_reference_model``); a RoundError naming the correction when it is missing."""
    if not (Path(export_dir) / "prodrl_export.json").exists():
        raise RoundError(f"correction={svc.settings.recipe.correction!r} needs the deployed export of {version}"
                         f"{f' ({why})' if why else ''} as the reference model, but {export_dir} holds no export")
    return Path(export_dir)


def check_recipe_fits_deployment(svc: Services, live: LiveDeployment) -> None:
    """A recipe that cannot work with this deployment fails before any data is touched."""
    if svc.settings.recipe.needs_reference_model:
        reference_export(svc, live.policy_version, Path(live.export_dir))


def version_dirs(svc: Services, policy_version: str) -> tuple[Path, Path]:
    """(checkpoint dir, export dir) of a deployed policy version (the live one, or an earlier one)."""
    live = svc.ledger.live()
    if live is not None and live.policy_version == policy_version:
        return Path(live.checkpoint_dir), Path(live.export_dir)
    if policy_version not in svc.ledger.version_order():
        raise RoundError(f"policy version {policy_version!r} was never deployed "
                         f"(deployed: {svc.ledger.version_order()})")
    return ensure_local(svc, "checkpoints", policy_version), ensure_local(svc, "exports", policy_version)


def refuse_if_decided(svc: Services, rkey: str, step: str) -> None:
    """A decided round's data, checkpoint and export are its history: re-running the step that made
    them is refused, naming the decision (an explicit re-evaluation goes beside: ``evaluate_version``)."""
    from prodrl_pipelines.loop.round_state import describe_decision, is_decided

    d = svc.ledger.decision(rkey)
    if is_decided(d):
        raise RoundError(f"{rkey} is decided ({describe_decision(d)}): re-running {step} would rewrite its history. "
                         f"Its recorded results stay; to re-evaluate its export run `prodrl eval --policy {rkey}` "
                         "(stored beside the original)")
