"""PostgreSQL state of the stack: one schema per service, created if missing, never dropped.

Dagster and MLflow both track their migrations in a table called ``alembic_version``; sharing a
schema makes the second one find a revision it does not know. Each gets ``<prefix>_dagster`` and
``<prefix>_mlflow``. A schema whose ``alembic_version`` holds a revision of neither service's own
migrations belongs to something else and is refused before any service starts.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

from prodrl_pipelines.config.preflight import PreflightError, libpq_dsn, redact

SERVICES = ("dagster", "mlflow")
_TITLE = {"dagster": "Dagster", "mlflow": "MLflow"}
_PREFIX = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")


@lru_cache(maxsize=None)
def known_revisions(service: str) -> frozenset[str]:
    """Every alembic revision of ``service``'s own migration scripts (installed package)."""
    from importlib.util import find_spec

    from alembic.script import ScriptDirectory

    where = {"dagster": ("_core", "storage", "alembic"), "mlflow": ("store", "db_migrations")}
    if service not in where:
        raise ValueError(f"unknown service {service!r}; valid: {', '.join(SERVICES)}")
    # the installed package's own migration scripts (found, not imported: importing is slow)
    path = os.path.join(os.path.dirname(find_spec(service).origin), *where[service])
    return frozenset(r.revision for r in ScriptDirectory(path).walk_revisions())


def with_schema(url: str, schema: str) -> str:
    """``url`` with ``search_path`` set to ``schema`` (libpq ``options``; both services accept it)."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


def schema_names(prefix: str) -> dict[str, str]:
    if not _PREFIX.match(prefix):
        raise PreflightError(f"schema prefix {prefix!r} must be lower-case letters, digits and '_' "
                             f"(starting with a letter or '_'), at most 41 characters")
    return {svc: f"{prefix}_{svc}" for svc in SERVICES}


def prepare_schemas(pg_url: str, prefix: str) -> dict[str, str]:
    """Create the services' schemas if missing (keeping what they hold) and check that each one is
    empty or already the right service's; returns ``{service: schema}``."""
    import psycopg2

    names = schema_names(prefix)
    conn = psycopg2.connect(libpq_dsn(pg_url), connect_timeout=5)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for svc, schema in names.items():
                cur.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                cur.execute("SELECT 1 FROM information_schema.tables WHERE table_schema = %s "
                            "AND table_name = 'alembic_version'", (schema,))
                if cur.fetchone() is None:
                    continue
                cur.execute(f'SELECT version_num FROM "{schema}".alembic_version')
                revs = [r[0] for r in cur.fetchall()]
                foreign = [r for r in revs if r not in known_revisions(svc)]
                if foreign:
                    owner = next((o for o in SERVICES if o != svc and foreign[0] in known_revisions(o)), None)
                    whose = f"it is {_TITLE[owner]}'s" if owner else "it is neither Dagster's nor MLflow's"
                    raise PreflightError(
                        f"PostgreSQL schema {schema!r} of {redact(pg_url)} is meant for {_TITLE[svc]}, but its "
                        f"alembic_version holds revision {foreign[0]!r}, which is not a {_TITLE[svc]} "
                        f"migration ({whose}). Another application owns that schema: start the stack with "
                        f"another --schema-prefix or another database (or drop the schema if it is yours)")
    finally:
        conn.close()
    return names
