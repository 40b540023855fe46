"""Checks that run before any work starts, so a bad service address fails fast and names its setting."""

from __future__ import annotations

import re


class PreflightError(RuntimeError):
    pass


def redact(url: str) -> str:
    """Hide the password of a database URL."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def libpq_dsn(url: str) -> str:
    """The libpq form of a SQLAlchemy URL (``postgresql+psycopg2://`` -> ``postgresql://``)."""
    return re.sub(r"^postgresql\+\w+://", "postgresql://", url)


def check_postgres(url: str, setting: str, timeout_s: int = 3) -> None:
    """Connect once to a PostgreSQL URL (SQLAlchemy or libpq form); raise naming ``setting``. The
    driver the URL names must be installed too: Dagster and MLflow open it through SQLAlchemy, whose
    default for a bare ``postgresql://`` is psycopg 3 since 2.1 (this package ships psycopg2)."""
    import psycopg2
    from sqlalchemy.engine import make_url

    try:
        make_url(url).get_dialect().import_dbapi()
    except ImportError as e:
        scheme = url.split("://", 1)[0]
        raise PreflightError(f"{setting}={redact(url)}: SQLAlchemy's driver for {scheme}:// is not installed "
                             f"({e}); write postgresql+psycopg2://...") from None
    except Exception:  # noqa: BLE001 - not a SQLAlchemy URL (libpq keywords): psycopg2 judges it below
        pass

    try:
        psycopg2.connect(libpq_dsn(url), connect_timeout=timeout_s).close()
    except Exception as e:  # noqa: BLE001 - any failure here means "cannot start"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PreflightError(f"{setting}={redact(url)} is unreachable: {msg}") from e
