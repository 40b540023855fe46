"""`prodrl` command line: operator commands on the same code the assets call.

    prodrl check-settings FILE               resolved settings as JSON, or the error naming the field (exit 1)
    prodrl bootstrap --settings FILE         round 0 from the model source (base_model), evaluated, live
    prodrl eval --settings FILE [--policy V] held-out reward of a policy version on the suite (JSON); a
                                             round's re-evaluation is stored beside its original
    prodrl review list|approve|reject|rollback  the reviewer's registry commands (cli/review.py)
    prodrl data stats|compact|vacuum|query|migrate  the trajectory store's tables (cli/data.py)
    prodrl rewards score|rescore              reward sources on stored traffic (cli/rewards.py)
    prodrl up / serve / record               the stack, the local engine server, the recording proxy

Packages add commands through the entry point group ``prodrl_pipelines.cli`` (a function taking the
subparsers object); the lab adds ``prodrl demo`` and ``prodrl lab ablate`` that way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

CLI_GROUP = "prodrl_pipelines.cli"


def cmd_check_settings(args) -> int:
    from pydantic import ValidationError

    from prodrl_pipelines.cluster.config import cluster_settings
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.evaluation import SuiteError
    from prodrl_pipelines.config.settings import SettingsFileError, load_settings_file, settings_from_flat
    from prodrl_pipelines.loop.settings_checks import check_before_work

    try:
        fields = load_settings_file(args.file)
        settings = settings_from_flat(fields)
        suite = check_before_work(settings, environment.read_store()["s3_endpoint_url"] or None)
        cluster_settings(fields).check_reachable()
    except ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(settings)"
            print(f"prodrl: {args.file}: {loc}: {err['msg']}", file=sys.stderr)
        return 1
    except (SettingsFileError, SuiteError, ValueError) as e:
        print(f"prodrl: {args.file}: {e}", file=sys.stderr)
        return 1
    shortfall = heldout_warning(settings, suite)
    if shortfall:
        print(f"prodrl: warning: {shortfall}", file=sys.stderr)
    print(json.dumps({**settings.model_dump(mode="json"), "home": str(settings.home_path), "suite_name": suite.name,
                      "heldout_tasks": min(settings.eval.heldout_size, suite_size(suite, settings))}, indent=1))
    return 0


def suite_size(suite, settings) -> int:
    """Held-out tasks the suite shows up front; a served suite's harness picks its own: taken as
    ``heldout_size`` (the evaluation reports how many it played)."""
    if not callable(getattr(suite, "heldout_tasks", None)):
        return settings.eval.heldout_size
    return len(suite.heldout_tasks(settings.eval.heldout_size))


def heldout_warning(settings, suite) -> str:
    """The held-out shortfall warning (``heldout_size`` above what the suite holds), or ""."""
    from prodrl_pipelines.evaluation.heldout import heldout_shortfall

    have = suite_size(suite, settings)
    return heldout_shortfall(settings.eval.heldout_size, have, suite.name) if have < settings.eval.heldout_size else ""


def cmd_bootstrap(args) -> int:
    from prodrl_pipelines.loop import bootstrap
    from prodrl_pipelines.loop.phases import PhaseMeter

    from prodrl_pipelines.cli.services import services_from_file

    svc = services_from_file(args.settings, with_lineage=True)
    if svc.ledger.live() is not None:
        print(f"prodrl: {svc.ledger.live().policy_version} is already live in {svc.settings.home_path}: round 0 "
              "exists (a new base model starts a new home)", file=sys.stderr)
        return 1
    out = bootstrap.bootstrap(svc)
    print(json.dumps({k: v for k, v in out.items() if k != "export"}, indent=1, default=str))
    print(PhaseMeter(out["phases"]).table(), file=sys.stderr)  # where the time and memory went
    return 0


def cmd_eval(args) -> int:
    from prodrl_pipelines.loop import evaluate

    from prodrl_pipelines.cli.services import services_from_file

    svc = services_from_file(args.settings, overrides={"eval_suite": args.suite} if args.suite else None)
    shortfall = heldout_warning(svc.settings, svc.suite)
    if shortfall:
        print(f"prodrl: warning: {shortfall}", file=sys.stderr)
    ev = evaluate.evaluate_version(svc, args.policy)
    print(json.dumps({"suite": svc.suite.name, **{k: ev[k] for k in (
        "policy_version", "mean", "ci95", "num_tasks", "heldout_size", "reward_errors", "first_reward_error",
        "stored_at", "task_ids", "rewards") if k in ev}}, indent=1))
    return 0


def cmd_up(args) -> int:
    from prodrl_pipelines.config.settings import load_settings_file
    from prodrl_pipelines.stack.stack import up

    settings = load_settings_file(args.settings) if args.settings else {}
    settings.pop("home", None)  # the stack's home is --home
    return up(Path(args.home), args.pg_url, settings, schema=args.schema_prefix, cluster=args.cluster)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prodrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check-settings", help="validate a settings file; print the resolved settings as JSON")
    c.add_argument("file", help="JSON or YAML file of ProdRLSettings fields")
    c.set_defaults(fn=cmd_check_settings)
    b = sub.add_parser("bootstrap", help="import the base model as round-000000, evaluate it and make it live")
    b.add_argument("--settings", required=True, help="JSON or YAML file of ProdRLSettings fields")
    b.set_defaults(fn=cmd_bootstrap)
    e = sub.add_parser("eval", help="held-out reward of a policy version on the evaluation suite (JSON)")
    e.add_argument("--settings", required=True, help="JSON or YAML file of ProdRLSettings fields")
    e.add_argument("--policy", default=None, help="policy version (default: the live one)")
    e.add_argument("--suite", default=None, help="evaluate on this suite instead of the settings' eval_suite "
                   "(e.g. inspect:pkg.module:task, verifiers:<taskset>, 'command:<command line>')")
    e.set_defaults(fn=cmd_eval)
    u = sub.add_parser("up", help="start the whole loop on loopback: S3 endpoint, MLflow server, Dagster "
                       "webserver + daemon (PostgreSQL), the deployment and its recorder")
    u.add_argument("--home", default="runs/stack")
    u.add_argument("--pg-url", default=os.environ.get("DAGSTER_PG_URL",
                                                      "postgresql+psycopg2://postgres@127.0.0.1:5432/test"))
    u.add_argument("--schema-prefix", default="prodrl",
                   help="PostgreSQL schemas <prefix>_dagster and <prefix>_mlflow (created if missing, kept)")
    u.add_argument("--settings", help="JSON or YAML file of ProdRLSettings fields")
    u.add_argument("--cluster", choices=("local", "ray"), default="local",
                   help="ray: start a local two-node Ray cluster and run the rounds' training, evaluation and "
                        "scoring on it (docs/ray.md)")
    u.set_defaults(fn=cmd_up)
    from prodrl_pipelines.cli.serve import add_serve_parser
    from prodrl_pipelines.cli.record import add_record_parser

    add_serve_parser(sub)  # prodrl serve: the local engine behind vLLM's OpenAI-compatible API
    add_record_parser(sub)  # prodrl record: the recording proxy (WAL, Parquet parts, feedback)
    from prodrl_pipelines.cli.review import add_review_parser

    add_review_parser(sub)  # prodrl review: approve, reject, roll back in the MLflow registry
    from prodrl_pipelines.cli.data import add_data_parser

    add_data_parser(sub)  # prodrl data: stats, compact, vacuum, query, migrate on the trajectory store
    from prodrl_pipelines.cli.rewards import add_rewards_parser

    add_rewards_parser(sub)  # prodrl rewards: score, rescore with the configured reward sources
    for ep in entry_points(group=CLI_GROUP):
        ep.load()(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prodrl_pipelines.evaluation import SuiteError
    from prodrl_pipelines.loop.model_source import ModelSourceError
    from prodrl_pipelines.config.preflight import PreflightError
    from prodrl_pipelines.loop.services import RoundError
    from prodrl_pipelines.config.settings import SettingsFileError

    try:
        return args.fn(args)
    except (PreflightError, SuiteError, ModelSourceError, SettingsFileError, RoundError) as e:
        print(f"prodrl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
