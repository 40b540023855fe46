"""The stack's state across restarts: PostgreSQL schemas of its own, kept; the S3 mirror."""

import os
import subprocess
import sys

import boto3
import psycopg2
import pytest

from prodrl_pipelines.config.preflight import PreflightError, libpq_dsn
from prodrl_pipelines.stack import s3_snapshot
from prodrl_pipelines.stack.postgres import known_revisions, prepare_schemas
from helpers import drop_schemas

from conftest import PG_URL, REPO


def _sql(sql: str, *args):
    conn = psycopg2.connect(libpq_dsn(PG_URL))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql, args)
        rows = cur.fetchall() if cur.description else None
    conn.close()
    return rows


@pytest.fixture
def prefix():
    p = f"stk_{os.getpid()}"
    yield p
    drop_schemas(PG_URL, p)


def test_schemas_are_created_once_and_kept(prefix):
    names = prepare_schemas(PG_URL, prefix)
    assert names == {"dagster": f"{prefix}_dagster", "mlflow": f"{prefix}_mlflow"}
    _sql(f'CREATE TABLE "{prefix}_dagster".kept (x int)')
    _sql(f'CREATE TABLE "{prefix}_mlflow".alembic_version (version_num varchar(32))')
    _sql(f'INSERT INTO "{prefix}_mlflow".alembic_version VALUES (%s)', sorted(known_revisions("mlflow"))[0])
    prepare_schemas(PG_URL, prefix)  # a restart: nothing dropped, MLflow's own revision accepted
    assert _sql("SELECT count(*) FROM information_schema.tables WHERE table_schema = %s AND table_name = 'kept'",
                f"{prefix}_dagster") == [(1,)]


def test_a_foreign_alembic_version_is_refused_naming_the_schema(prefix):
    prepare_schemas(PG_URL, prefix)
    mlflow_rev = sorted(known_revisions("mlflow"))[0]
    assert mlflow_rev not in known_revisions("dagster")
    _sql(f'CREATE TABLE "{prefix}_dagster".alembic_version (version_num varchar(32))')
    _sql(f'INSERT INTO "{prefix}_dagster".alembic_version VALUES (%s)', mlflow_rev)
    with pytest.raises(PreflightError) as e:
        prepare_schemas(PG_URL, prefix)
    msg = str(e.value)
    assert f"{prefix}_dagster" in msg and mlflow_rev in msg and "MLflow's" in msg and "--schema-prefix" in msg
    # the command line says the same, exits 2, and starts nothing
    out = subprocess.run([sys.executable, "-m", "prodrl_pipelines.cli", "up", "--home", str(REPO / "runs" / "never"),
                          "--pg-url", PG_URL, "--schema-prefix", prefix], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert f"{prefix}_dagster" in out.stderr and "Traceback" not in out.stderr
    assert not (REPO / "runs" / "never").exists()


def test_a_bad_schema_prefix_fails_before_connecting():
    with pytest.raises(PreflightError, match="schema prefix"):
        prepare_schemas("postgresql+psycopg2://nobody@127.0.0.1:1/none", "Bad-Prefix; DROP")


def test_s3_mirror_round_trip(s3_endpoint, bucket, tmp_path):
    c = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    objs = {"a": b"1", "a/b": b"22", "deep/x/y/z.parquet": os.urandom(1000), "gone": b"x"}
    for k, v in objs.items():
        c.put_object(Bucket=bucket, Key=k, Body=v)
    root = tmp_path / "mirror"
    first = s3_snapshot.save(c, bucket, root)
    assert first == {"objects": 4, "downloaded": 4, "deleted": 0, "bytes": sum(len(v) for v in objs.values())}
    c.delete_object(Bucket=bucket, Key="gone")
    c.put_object(Bucket=bucket, Key="a", Body=b"changed")
    second = s3_snapshot.save(c, bucket, root)
    assert (second["downloaded"], second["deleted"], second["objects"]) == (1, 1, 3)  # unchanged ones not fetched
    assert len(list((root / "objects").iterdir())) == 3
    fresh = f"{bucket}-restored"
    c.create_bucket(Bucket=fresh)
    assert s3_snapshot.restore(c, fresh, root) == 3
    got = {o["Key"]: c.get_object(Bucket=fresh, Key=o["Key"])["Body"].read()
           for o in c.list_objects_v2(Bucket=fresh)["Contents"]}
    assert got == {"a": b"changed", "a/b": b"22", "deep/x/y/z.parquet": objs["deep/x/y/z.parquet"]}
    assert s3_snapshot.restore(c, fresh, tmp_path / "no-mirror") == 0


def test_the_stacks_recorder_renders_chat_as_the_deploy_settings_ask():
    """``chat_history: extend`` (with the deployment's reply parser) reaches ``make up``'s recorder,
    in a command line ``prodrl record``'s own parser accepts."""
    import argparse

    from prodrl_pipelines.cli.record import add_record_parser
    from prodrl_pipelines.config.settings import settings_from_flat
    from prodrl_pipelines.stack.serving import recorder_args

    parser = argparse.ArgumentParser()
    add_record_parser(parser.add_subparsers(dest="cmd"))
    for flat, want in (({}, ("rerender", "none")), ({"chat_history": "extend", "reply_parser": "qwen3"}, ("extend", "qwen3"))):
        deploy = settings_from_flat(flat).deploy
        args = parser.parse_args(recorder_args(deploy, "/h/endpoint.json", ["--store", "/h/store"], 8123))
        assert (args.chat_history, args.reply_parser, args.follow, args.port) == (*want, "/h/endpoint.json", 8123)


def test_a_recorder_following_a_deployment_sends_the_deployments_key_upstream(monkeypatch):
    """Replicas started with ``PRODRL_DEPLOY_API_KEY`` refuse calls without it: a recorder following
    that deployment's record sends it, unless ``PRODRL_UPSTREAM_API_KEY`` names another; a recorder
    in front of one ``--upstream`` server sends only the upstream key."""
    import argparse

    from prodrl_pipelines.cli.record import add_record_parser, recorder_config

    parser = argparse.ArgumentParser()
    add_record_parser(parser.add_subparsers(dest="cmd"))
    follow = parser.parse_args(["record", "--follow", "/h/endpoint.json", "--store", "/h/store"])
    upstream = parser.parse_args(["record", "--upstream", "http://127.0.0.1:9", "--store", "/h/store"])
    monkeypatch.delenv("PRODRL_UPSTREAM_API_KEY", raising=False)
    monkeypatch.setenv("PRODRL_DEPLOY_API_KEY", "fleet-key")
    assert recorder_config(follow, "t").upstream_api_key == "fleet-key"
    assert recorder_config(upstream, "t").upstream_api_key is None
    monkeypatch.setenv("PRODRL_UPSTREAM_API_KEY", "own-key")
    assert recorder_config(follow, "t").upstream_api_key == "own-key"
    assert recorder_config(upstream, "t").upstream_api_key == "own-key"
