"""Dagster resources: thin typed wrappers that build the core objects (validated at run start)."""


from types import UnionType
from typing import Literal, Optional, Union, get_args, get_origin

from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field, PrivateAttr, create_model

from prodrl_pipelines.cluster.config import ClusterSettings, cluster_settings
from prodrl_pipelines.config import environment
from prodrl_pipelines.loop.services import Services, build_services
from prodrl_pipelines.config.settings import Settings, field_info, flat_fields, settings_from_flat
from prodrl_pipelines.loop.settings_checks import check_before_work
from prodrl_pipelines.loop.lineage import Lineage, open_lineage
from prodrl_pipelines.storage.locations import StoreLocation


def _config_type(annotation):
    """A Dagster-config-friendly type for a core field (the core model re-validates the value)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation in (int, float, str, bool):
        return annotation
    if origin is Literal:
        return type(args[0])
    if origin is tuple:
        return list[args[0]]
    if origin is dict:
        return dict[args[0], _config_type(args[1])]
    if origin in (Union, UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return Optional[_config_type(inner[0])]
    raise TypeError(f"no Dagster config type for settings annotation {annotation!r}")


def _resource_fields() -> dict:
    out = {}
    for flat in flat_fields():
        info = field_info(flat)
        default = info.get_default(call_default_factory=True)
        default = list(default) if isinstance(default, tuple) else default
        out[flat] = (_config_type(info.annotation), Field(default, description=info.description))
    # execution: >1 launches torchrun with this many ranks through Dagster Pipes
    out["train_processes"] = (int, Field(1, description="training ranks (1: in-process)"))
    for name, info in ClusterSettings.model_fields.items():  # where the heavy steps run (local or Ray)
        out[name] = (_config_type(info.annotation), Field(info.default, description=info.description))
    return out


class ProdRLSettings(create_model("_ProdRLSettingsFields", __base__=ConfigurableResource, __module__=__name__,
                                  **_resource_fields())):
    """Every core setting under one flat name (``settings.flat_fields``): the recipe, serving, the
    evaluation suite and gate, the base model, the lab. Generated from the core models, so a field
    added there is settable here, in settings files and in PRODRL_SETTINGS_JSON at once."""

    def fields(self) -> dict:
        """Plain field values (to hand the same settings to a subprocess)."""
        return {k: getattr(self, k) for k in type(self).model_fields}

    def settings(self) -> Settings:
        """Validate into the core settings; a bad value fails here, naming the setting."""
        return settings_from_flat(self.fields())

    def cluster_config(self) -> ClusterSettings:
        """Where the heavy steps run; a bad value fails here, naming the setting."""
        return cluster_settings(self.fields())

    def setup_for_execution(self, context: InitResourceContext) -> None:
        check_before_work(self.settings())  # fail before any asset runs
        self.cluster_config().check_reachable()


class MlflowResource(ConfigurableResource):
    """A thin resource over MlflowClient (through the core ``Lineage``, opened by ``open_lineage``)."""

    tracking_uri: str = ""  # empty: sqlite under the settings home
    experiment: str = "prodrl"
    model_name: str = "prodrl-policy"
    artifact_location: str = ""
    # where links to runs and model versions open (empty: $MLFLOW_UI_URL, else the tracking server,
    # else http://127.0.0.1:5000 where `mlflow ui` on the local SQLite store listens)
    ui_url: str = ""
    _lineage: Lineage | None = PrivateAttr(default=None)

    def lineage(self, settings: Settings) -> Lineage:
        if self._lineage is None:
            self._lineage = open_lineage(settings, self.tracking_uri, self.experiment, self.model_name,
                                         self.artifact_location, self.ui_url)
        return self._lineage


class StoreResource(ConfigurableResource):
    """Where trajectories, rewards, round documents, checkpoints and exports live (``StoreLocation``)."""

    root: str = ""  # local: empty means <home>/store
    s3_bucket: str = ""  # empty: local directories
    s3_prefix: str = ""
    s3_endpoint_url: str = ""  # empty: AWS; else an S3-compatible server (MinIO, moto, ...)
    s3_region: str = ""  # empty: the boto3 default (AWS_REGION / profile), else us-east-1

    def location(self) -> StoreLocation:
        return StoreLocation(self.root, self.s3_bucket, self.s3_prefix, self.s3_endpoint_url, self.s3_region)


def open_services(settings: ProdRLSettings, store: StoreResource, mlflow: MlflowResource | None = None) -> Services:
    s = settings.settings()
    return build_services(s, store.location(), mlflow.lineage(s) if mlflow is not None else None)


def make_resources(settings: dict, store_root: str = "", tracking_uri: str = "", s3: dict | None = None) -> dict:
    """Resources from plain values; ``settings`` holds ProdRLSettings fields (validated here);
    ``s3`` optional StoreResource S3 fields (s3_bucket, s3_prefix, s3_endpoint_url, s3_region)."""
    from dagster import PipesSubprocessClient

    settings_from_flat(settings)  # unknown names fail here
    cluster_settings(settings)
    res = {
        "settings": ProdRLSettings(**settings),
        "store": StoreResource(root=store_root, **(s3 or {})),
        "mlflow": MlflowResource(tracking_uri=tracking_uri),
        "pipes": PipesSubprocessClient(),
    }
    check_before_work(res["settings"].settings(), (s3 or {}).get("s3_endpoint_url") or None)  # fails at load time
    return res


def resources_from_env(overrides: dict) -> dict:
    """Resources from ``overrides`` (flat settings) and the stores and tracking URI of the environment
    (``environment``)."""
    store = environment.read_store()
    return make_resources(overrides, store.pop("root"), environment.tracking_uri(), store)


def default_resources() -> dict:
    """Resources of the code location, all from the environment (``environment.read_settings``)."""
    return resources_from_env(environment.read_settings())
