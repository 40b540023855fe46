"""``prodrl lab ablate``: load and validate the config, run the recipes x seeds, write the report, log
it to MLflow and print the table (README "Ablations"); :func:`add_ablate_parser` registers it under
``prodrl lab`` (``lab.cli.add_lab_commands``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prodrl_pipelines.lab.ablation_config import AblationConfigError, load_config
from prodrl_pipelines.lab.ablation_report import TABLE_COLUMNS, log_to_mlflow, table_rows, write_report
from prodrl_pipelines.lab.ablation_runner import load_results, run_ablation


def add_ablate_parser(lab_sub) -> None:
    a = lab_sub.add_parser("ablate", help="run the pipeline for several recipes x seeds; report + plots")
    a.add_argument("--config", required=True, help="YAML ablation config (e.g. ablations/default.yaml)")
    a.add_argument("--name", help="override the config's name (results under <runs-dir>/<name>/)")
    a.add_argument("--quick", action="store_true",
                   help="smoke test: tiny lab policy and sizes, first seed only, at most 2 rounds")
    a.add_argument("--workers", type=int, default=2, help="concurrent run subprocesses (one torch thread each)")
    a.add_argument("--seeds", type=int, nargs="+", help="override the config's seeds")
    a.add_argument("--recipes", nargs="+", help="run only these recipes of the config")
    a.add_argument("--rounds", type=int, help="override the config's rounds (use a new --name: finished runs "
                                              "are skipped whatever their rounds)")
    a.add_argument("--runs-dir", default="runs")
    a.add_argument("--no-mlflow", action="store_true", help="do not log the report to MLflow")
    a.set_defaults(fn=cmd_ablate)


def _terminate_runs_on_sigterm() -> None:
    """`kill` of the runner (not only Ctrl-C) must stop its run subprocesses too: a run left behind
    would race the rerun that restarts it in the same home. SIGTERM becomes SystemExit, which
    `run_ablation`'s cleanup handles like KeyboardInterrupt (terminate, then kill, the workers)."""
    import signal

    def _exit(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def cmd_ablate(args) -> int:
    try:
        cfg = load_config(args.config, quick=args.quick, name=args.name, seeds=args.seeds, recipes=args.recipes,
                          rounds=args.rounds)
    except AblationConfigError as e:
        print(f"prodrl lab ablate: {e}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("prodrl lab ablate: --workers must be >= 1", file=sys.stderr)
        return 2
    root = (Path(args.runs_dir) / cfg.name).resolve()
    t0 = time.time()
    _terminate_runs_on_sigterm()
    out = run_ablation(cfg, root, workers=args.workers, progress=sys.stderr.isatty())
    wall = time.time() - t0
    results, failures = load_results(cfg, root)
    rep = write_report(cfg, root, results, failures, wall_s=wall if out.ran else None)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ablation {cfg.name}")
    for c in TABLE_COLUMNS:
        t.add_column(c)
    for row in table_rows(rep["table"]):
        t.add_row(*row)
    Console(width=180).print(t)
    for c in rep["claims"]:
        print(f"  {'HOLDS' if c['holds'] else ('NO DATA' if c['holds'] is None else 'DOES NOT HOLD')}: {c['text']}")
    if not args.no_mlflow:
        uri, rid = log_to_mlflow(cfg, root, rep)
        print(f"MLflow: run {rid} in experiment ablation/{cfg.name} ({uri})")
    print(f"{out.ran} ran, {out.skipped} skipped (already done), {out.failed} failed in {wall / 60:.1f} min; "
          f"report: {rep['report']}")
    return 0 if not failures else 1
