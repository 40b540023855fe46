"""`prodrl rewards`: the reward sources' verbs on the stored traffic.

    prodrl rewards score   --settings FILE                  score the live window's unrewarded trajectories
    prodrl rewards rescore --settings FILE --source NAME [--versions V ...]
                                                            re-score stored trajectories with the source's
                                                            current version (old rows kept); reports changes
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict


def cmd_rewards(args) -> int:
    from prodrl_pipelines.cli.services import services_from_file
    from prodrl_pipelines.loop import scoring

    try:
        svc = services_from_file(args.settings)
    except ValueError as e:  # a bad setting (or file): named as `prodrl check-settings` names it
        print(f"prodrl: {args.settings}: {e}", file=sys.stderr)
        return 1
    if args.verb == "score":
        stats = scoring.score_missing_now(svc)
        print(json.dumps({k: v for k, v in stats.items() if k != "rewards"}, indent=1, default=str))
        return 0
    if not args.source:
        print("prodrl: rewards rescore needs --source NAME (a configured scorer: "
              f"{', '.join(svc.settings.rewards.scorers) or 'none configured'})", file=sys.stderr)
        return 2
    try:
        rep = scoring.rescore(svc, args.source, args.versions or None)
    except ValueError as e:
        print(f"prodrl: {e}", file=sys.stderr)
        return 2
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
