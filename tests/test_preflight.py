"""Unreachable services fail before any work starts, naming the setting."""

import os
import re
import subprocess
import sys

import pytest

from prodrl_pipelines.config.preflight import PreflightError, check_postgres, redact


def test_redacts_password():
    assert redact("postgresql+psycopg2://u:secret@h:5432/db") == "postgresql+psycopg2://u:***@h:5432/db"


def test_reachable_postgres_passes(pg_url):
    check_postgres(pg_url, "DAGSTER_PG_URL")


def test_unreachable_postgres_names_setting():
    with pytest.raises(PreflightError, match=r"DAGSTER_PG_URL=postgresql\+psycopg2://u:\*\*\*@127.0.0.1:1/x is unreachable"):
        check_postgres("postgresql+psycopg2://u:pw@127.0.0.1:1/x", "DAGSTER_PG_URL", timeout_s=1)


def test_a_url_whose_sqlalchemy_driver_is_missing_names_the_setting_and_the_fix(pg_url):
    """Dagster opens the URL through SQLAlchemy, whose bare ``postgresql://`` means psycopg 3 since
    2.1; the server answering (psycopg2 reaches it) does not make the URL usable."""
    import importlib.util

    missing = next(d for d in ("pg8000", "asyncpg", "psycopg") if importlib.util.find_spec(d) is None)
    scheme = "postgresql" if missing == "psycopg" else f"postgresql+{missing}"
    url = pg_url.replace("postgresql+psycopg2://", f"{scheme}://")
    with pytest.raises(PreflightError, match=rf"DAGSTER_PG_URL={re.escape(scheme)}.*driver .*not installed.*postgresql\+psycopg2"):
        check_postgres(url, "DAGSTER_PG_URL")


def test_demo_with_unreachable_database_starts_nothing(tmp_path):
    env = {**os.environ, "PRODRL_DAGSTER_HOME": str(tmp_path), "DAGSTER_PG_URL": "postgresql+psycopg2://u@127.0.0.1:1/x"}
    out = subprocess.run([sys.executable, "-m", "prodrl_pipelines.cli", "demo", "--name", "x", "--runs-dir",
                          str(tmp_path / "runs")], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "DAGSTER_PG_URL=postgresql+psycopg2://u@127.0.0.1:1/x is unreachable" in out.stderr
    assert not (tmp_path / "runs" / "x" / "checkpoints").exists()
