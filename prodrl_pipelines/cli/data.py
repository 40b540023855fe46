"""`prodrl data`: the operator's verbs on the trajectory store (``trajectories.maintenance``).

    prodrl data stats   --settings FILE            per policy version: calls, trajectories, rewarded,
                                                   eligible, used, quarantined, files, bytes
    prodrl data merges  --settings FILE [--policy-version V ...]   per policy version: multi-call
                                                   trajectories, how many train as one sequence, the
                                                   sequences they give, the splits by reason
    prodrl data compact --settings FILE            compact small files, checkpoint the logs
    prodrl data vacuum  --settings FILE [--retention-hours H] [--dry-run]
    prodrl data query   --settings FILE "SQL"      DuckDB over calls, rewards, retractions, quarantine, ledger
    prodrl data migrate --settings FILE [--delete-legacy]   the earlier part-file layout into the tables
    prodrl data erase   --settings FILE (--tenant T | --trajectory ID ... | --before DATE) [--by WHO] [--reason WHY]
                        [--dry-run]      every row of those trajectories deleted and its files removed; an
                                         audit row; MLflow versions of rounds that trained on them tagged
"""

from __future__ import annotations

import json
import sys


def _store(args):
    from prodrl_pipelines.cli.services import services_from_file

    # erase marks the MLflow versions of rounds that trained on what it erased
    return services_from_file(args.settings, with_lineage=args.verb == "erase")


def _print_rows(rows: list[dict], as_json: bool) -> None:
    if as_json or not rows:
        print(json.dumps(rows, indent=1, default=str))
        return
    cols = list(rows[0])
    widths = [max(len(str(c)), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))


def cmd_data(args) -> int:
    from prodrl_pipelines.trajectories import maintenance
    from prodrl_pipelines.trajectories.migrate import MigrationError, legacy_parts, migrate

    svc = _store(args)
    store = svc.store
    if args.verb == "stats":
        rows = maintenance.stats(store)
        _print_rows(rows, args.json)
        legacy = sum(len(v) for v in legacy_parts(store).values())
        if legacy:
            print(f"prodrl: {legacy} parts of the earlier layout are not in the tables: run `prodrl data migrate`",
                  file=sys.stderr)
    elif args.verb == "merges":
        from prodrl_pipelines.rl.merge_report import merge_rows

        _print_rows(merge_rows(store, args.policy_version), args.json)
    elif args.verb == "compact":
        print(json.dumps(maintenance.compact(store), indent=1))
    elif args.verb == "vacuum":
        from prodrl_pipelines.loop.data import in_flight_pins

        out = maintenance.vacuum(store, args.retention_hours, in_flight_pins(svc), dry_run=args.dry_run)
        print(json.dumps(out, indent=1))
    elif args.verb == "query":
        try:
            _print_rows(maintenance.query(store, args.sql).to_pylist(), args.json)
        except ValueError as e:
            print(f"prodrl: {e}", file=sys.stderr)
            return 1
    elif args.verb == "erase":
        from datetime import datetime

        from prodrl_pipelines.loop.data_erasure import erase
        from prodrl_pipelines.trajectories.erasure import Erasure, ErasureError

        try:
            before = datetime.fromisoformat(args.before) if args.before else None
            req = Erasure(tenant=args.tenant, trajectory_ids=args.trajectory or [], before=before,
                          requested_by=args.by, reason=args.reason)
            print(json.dumps(erase(svc, req, dry_run=args.dry_run), indent=1, default=str))
        except (ErasureError, ValueError) as e:
            print(f"prodrl data erase: {e}", file=sys.stderr)
            return 2
    elif args.verb == "migrate":
        try:
            kw = {} if args.batch_rows is None else {"batch_rows": args.batch_rows}
            print(json.dumps(migrate(store, delete_legacy=args.delete_legacy, **kw), indent=1))
        except MigrationError as e:
            print(f"prodrl: {e}", file=sys.stderr)
            return 1
    return 0


def add_data_parser(sub) -> None:
    d = sub.add_parser("data", help="the trajectory store: stats, merges, compact, vacuum, query (DuckDB SQL), migrate")
    d.add_argument("verb", choices=["stats", "merges", "compact", "vacuum", "query", "migrate", "erase"])
    d.add_argument("sql", nargs="?", default=None, help="for `query`: the SQL (tables calls, rewards, retractions, "
                   "quarantine, ledger)")
    d.add_argument("--settings", required=True, help="JSON or YAML file of ProdRLSettings fields")
    d.add_argument("--json", action="store_true", help="print rows as JSON")
    d.add_argument("--policy-version", action="append", default=None,
                   help="merges: this policy version only (repeat for several; default every version)")
    d.add_argument("--retention-hours", type=float, default=168.0,
                   help="vacuum: keep files unreferenced for less than this (default 168 = 7 days)")
    d.add_argument("--dry-run", action="store_true", help="vacuum, erase: say what would go, delete nothing")
    d.add_argument("--tenant", default=None, help="erase: every trajectory this tenant's recorder stored")
    d.add_argument("--trajectory", action="append", default=None, metavar="ID",
                   help="erase: this trajectory, as stored (repeat for several)")
    d.add_argument("--before", default=None, metavar="DATE",
                   help="erase: trajectories whose last call is older (ISO 8601 with its zone, e.g. 2026-01-01T00:00+00:00)")
    d.add_argument("--by", default="", help="erase: who asked (kept in the audit table)")
    d.add_argument("--reason", default="", help="erase: why (kept in the audit table; no personal data here)")
    d.add_argument("--delete-legacy", action="store_true", help="migrate: then remove the old parts, each only once its rows are all in its table")
    d.add_argument("--batch-rows", type=int, default=None,
                   help="migrate: rows read into memory per commit (default 200000)")
    d.set_defaults(fn=cmd_data)
