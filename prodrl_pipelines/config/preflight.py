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
    """Connect once to a PostgreSQL URL (SQLAlchemy or libpq form); raise naming ``setting``."""
    import psycopg2

    try:
        psycopg2.connect(libpq_dsn(url), connect_timeout=timeout_s).close()
    except Exception as e:  # noqa: BLE001 - any failure here means "cannot start"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PreflightError(f"{setting}={redact(url)} is unreachable: {msg}") from e
