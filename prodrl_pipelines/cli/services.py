"""The services a command works on: a settings file, and the stores and tracking server of the
environment (``config.environment``)."""

from __future__ import annotations


def services_from_file(path: str, *, with_lineage: bool = False, overrides: dict | None = None):
    """The services of a settings file (flat settings fields, ``overrides`` on top) and the
    environment's stores and tracking server; the settings and the suite are checked before any work."""
    from prodrl_pipelines.config.settings import load_settings_file
    from prodrl_pipelines.loop.services import services_from_env

    return services_from_env({**load_settings_file(path), **(overrides or {})}, with_lineage=with_lineage, check=True)
