"""`prodrl rewards`: the reward sources' verbs on the stored traffic.

    prodrl rewards score   --settings FILE                  score the live window's unrewarded trajectories
    prodrl rewards rescore --settings FILE --source NAME [--versions V ...]
                                                            re-score stored trajectories with the source's
                                                            current version (old rows kept); reports changes

With ``cluster: ray`` and ``cluster_scoring_workers`` above 0 in the settings file, either verb runs
as a Ray job scoring on a Ray Data actor pool (``ops.ray_scoring``); the output is the same.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict


def _on_ray(fields: dict, cluster, svc, step: str, argv: list[str]) -> dict | None:
    """The step's result from a Ray job when the settings ask for Ray scoring, else None."""
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.rewards.runners import runner_for

    if runner_for(cluster).name != "ray":
        return None
    from prodrl_pipelines.cluster.jobs import run_job

    return run_job(cluster, step, argv, {**fields, "home": str(svc.settings.home_path)}, environment.read_store(),
                   f"{step}-cli")


def cmd_rewards(args) -> int:
    from prodrl_pipelines.cli.services import services_from_file
    from prodrl_pipelines.cluster.config import cluster_settings
    from prodrl_pipelines.config.settings import load_settings_file
    from prodrl_pipelines.loop import scoring
    from prodrl_pipelines.rewards.scoring import RescoreReport, check_rescore_source

    try:
        svc = services_from_file(args.settings)
        fields = load_settings_file(args.settings)
        cluster = cluster_settings(fields)
    except ValueError as e:  # a bad setting (or file): named as `prodrl check-settings` names it
        print(f"prodrl: {args.settings}: {e}", file=sys.stderr)
        return 1
    if args.verb == "score":
        try:
            stats = _on_ray(fields, cluster, svc, "score", []) or scoring.score_missing_now(svc)
        except RuntimeError as e:  # the Ray job failed (its log's tail is in the message)
            print(f"prodrl: {e}", file=sys.stderr)
            return 1
        print(json.dumps({k: v for k, v in stats.items() if k != "rewards"}, indent=1, default=str))
        return 0
    if not args.source:
        print("prodrl: rewards rescore needs --source NAME (a configured scorer: "
              f"{', '.join(svc.settings.rewards.scorers) or 'none configured'})", file=sys.stderr)
        return 2
    try:
        check_rescore_source(svc.rewards, args.source)  # before any job is submitted
        argv = [args.source] + (["--versions", *args.versions] if args.versions else [])
        out = _on_ray(fields, cluster, svc, "rescore", argv)
        rep = RescoreReport(**out) if out is not None else scoring.rescore(svc, args.source, args.versions or None)
    except ValueError as e:
        print(f"prodrl: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the Ray job failed (its log's tail is in the message)
        print(f"prodrl: {e}", file=sys.stderr)
        return 1
    print(rep.summary(), file=sys.stderr)
    print(json.dumps(asdict(rep), indent=1))
    return 0


def add_rewards_parser(sub) -> None:
    r = sub.add_parser("rewards", help="reward sources on the stored traffic: score what lacks a reward, re-score")
    r.add_argument("verb", choices=["score", "rescore"])
    r.add_argument("--settings", required=True, help="JSON or YAML file of ProdRLSettings fields")
    r.add_argument("--source", default=None, help="rescore: the source (grader or judge)")
    r.add_argument("--versions", nargs="*", default=None,
                   help="rescore: only trajectories scored by these versions (default: every older version)")
    r.set_defaults(fn=cmd_rewards)
