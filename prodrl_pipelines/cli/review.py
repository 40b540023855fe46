"""`prodrl review`: the reviewer's commands. Each writes the registry state a reviewer would write in
the MLflow UI (a tag, an alias), so the registry sensor acts on either the same way.

    prodrl review list     --settings FILE                     pending and recent versions
    prodrl review approve  VERSION --settings FILE [--by NAME]  tag review=approved (deployed at the next tick)
    prodrl review reject   VERSION --reason TEXT --settings FILE [--by NAME]
    prodrl review rollback VERSION --settings FILE [--by NAME]  move champion back to a deployed version
    prodrl review end-canary VERSION --promote|--fail --settings FILE [--by NAME]  end a running canary now
"""

from __future__ import annotations

import getpass
import json
import sys

from prodrl_pipelines.loop import review
from prodrl_pipelines.loop import round_state
from prodrl_pipelines.loop.lineage import ROUND_TAG


def _services(settings_path: str):
    from prodrl_pipelines.cli.services import services_from_file

    return services_from_file(settings_path, with_lineage=True)


def version_rows(svc, limit: int = 20) -> list[dict]:
    """The registry's versions, newest first, joined with their recorded decisions."""
    live = svc.ledger.live()
    rows = []
    for mv in reversed(svc.lineage.versions()):
        rkey = mv.tags.get(ROUND_TAG, "")
        d = svc.ledger.decision(rkey) if rkey else None
        state = round_state.version_state(rkey, d)
        d = d or {}
        rows.append({
            "version": str(mv.version), "round": rkey, "state": state, "live": bool(live and live.model_version == str(mv.version)),
            "gate": mv.tags.get("gate", ""), "review": mv.tags.get("review", "none"), "deployed": mv.tags.get("deployed", ""),
            "heldout_reward": d.get("candidate_mean"), "live_reward_at_gate": d.get("live_mean"),
            "mean_diff": d.get("mean_diff"), "diff_lower": d.get("diff_lower"), "tolerance": d.get("tolerance"),
            "decided_by": d.get("decided_by", ""), "refused": mv.tags.get(review.REFUSED, ""),
            "monitors": monitor_cell(d.get("monitors") or []), "warnings": d.get("warnings") or [],
            "cumulative": monitor_cell(d.get("cumulative_monitors") or []), "reference": d.get("reference_version") or "",
        })
    pending = [r for r in rows if r["state"] == round_state.PENDING_REVIEW]
    return pending + [r for r in rows if r["state"] != round_state.PENDING_REVIEW][:limit]


def monitor_cell(monitors: list[dict]) -> str:
    """The behaviour monitors in one cell: ``ok`` when all passed, else each failing one's verdict
    (the ``monitors`` column is against live, ``cumulative`` against the ``reference`` policy)."""
    bad = [f"{m['name']}:{'BLOCKS' if m['blocking'] else 'warn'}({m['value']:+.3g})" for m in monitors if not m["passed"]]
    return ", ".join(bad) if bad else ("ok" if monitors else "-")


def _fmt(x) -> str:
    return "-" if x is None or x != x else f"{x:+.3f}" if isinstance(x, float) and x < 0 else \
        f"{x:.3f}" if isinstance(x, float) else str(x)


def cmd_list(args) -> int:
    rows = version_rows(_services(args.settings), args.limit)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
        return 0
    cols = ("version", "round", "state", "heldout_reward", "live_reward_at_gate", "mean_diff", "diff_lower",
            "tolerance", "monitors", "cumulative", "reference", "decided_by")
    table = [["v" if c == "version" else c for c in cols]] + [
        [("*" if r["live"] else "") + _fmt(r[c]) if c == "version" else _fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("(* = live)")
    return 0


def _version(svc, version: str):
    from mlflow.exceptions import MlflowException

    try:
        return svc.lineage.version(version)
    except MlflowException:
        raise SystemExit(f"prodrl: model {svc.lineage.model_name!r} has no version {version!r}") from None


def _refuse_unless(ok: bool, msg: str) -> None:
    if not ok:
        print(f"prodrl: {msg}", file=sys.stderr)
        raise SystemExit(1)


def _round_in_state(args, state: str, what: str):
    """(services, round key) of ``args.version``, refused unless its round is in ``state``."""
    svc = _services(args.settings)
    rkey = _version(svc, args.version).tags.get(ROUND_TAG, "")
    decision = svc.ledger.decision(rkey)
    _refuse_unless(round_state.round_state(decision) == state, f"version {args.version} ({rkey}) is not {what}: "
                   f"{round_state.describe_decision(decision)}")
    return svc, rkey


def cmd_decide(args) -> int:
    """approve / reject: the review tags (who, then the decision: the sensor reads them in that order)."""
    svc, rkey = _round_in_state(args, round_state.PENDING_REVIEW, "awaiting review")
    tags = {review.REVIEW_BY: args.by}
    if args.cmd_review == "reject":
        tags[review.REVIEW_REASON] = args.reason
    svc.lineage.tag_version(args.version, {**tags, "review": "approved" if args.cmd_review == "approve" else "rejected"})
    print(f"version {args.version} ({rkey}) {args.cmd_review}d by {args.by}; the registry sensor "
          f"{'deploys it' if args.cmd_review == 'approve' else 'closes the round'} at its next tick")
    return 0


def cmd_end_canary(args) -> int:
    """end-canary: promote the canary now (full rollout) or fail it (removed); the canary sensor acts."""
    from prodrl_pipelines.loop import canary

    svc, rkey = _round_in_state(args, round_state.CANARY, "a running canary")
    acted = canary.promotion_by(svc, rkey)  # a verdict acted on is final
    _refuse_unless(not acted, f"the canary of version {args.version} ({rkey}) passed and its rollout was "
                   f"requested by {acted.get('by')} at {acted.get('at')}: that verdict is final")
    outcome = "promote" if args.promote else "fail"
    svc.lineage.tag_version(args.version, {canary.END_BY_TAG: args.by, canary.END_TAG: outcome})
    print(f"canary of version {args.version} ({rkey}) ended by {args.by}: the canary sensor "
          f"{'rolls it out to every replica' if args.promote else 'removes it'} at its next tick")
    return 0


def cmd_rollback(args) -> int:
    from prodrl_pipelines.loop.lineage import CHAMPION

    svc = _services(args.settings)
    mv = _version(svc, args.version)
    rkey = mv.tags.get(ROUND_TAG, "")
    live = svc.ledger.live()
    deployed = round_state.version_state(rkey, svc.ledger.decision(rkey)) == round_state.DEPLOYED
    _refuse_unless(deployed, f"version {args.version} ({rkey}) was never deployed "
                   f"({round_state.describe_decision(svc.ledger.decision(rkey))}): only a deployed version can be "
                   "rolled back to")
    _refuse_unless(not live or live.model_version != args.version, f"version {args.version} ({rkey}) is live already")
    svc.lineage.client.set_registered_model_tag(svc.lineage.model_name, review.ROLLBACK_BY, args.by)
    svc.lineage.client.set_registered_model_alias(svc.lineage.model_name, CHAMPION, args.version)
    print(f"champion -> version {args.version} ({rkey}) by {args.by}; the registry sensor rolls the deployment "
          "back to it at its next tick")
    return 0


def add_review_parser(sub) -> None:
    r = sub.add_parser("review", help="review candidates in the MLflow registry: list, approve, reject, rollback",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    rs = r.add_subparsers(dest="cmd_review", required=True)

    def common(p):
        p.add_argument("--settings", required=True, help="JSON or YAML file of ProdRLSettings fields")

    def who(p):
        p.add_argument("--by", default=getpass.getuser(), help="who decides (recorded in lineage; default: $USER)")

    ls = rs.add_parser("list", help="pending and recent model versions with their gate numbers and review state")
    common(ls)
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)
    for name, help_ in (("approve", "approve a pending version: it is deployed through the deploy target"),
                        ("reject", "reject a pending version: its round closes, nothing is deployed")):
        p = rs.add_parser(name, help=help_)
        p.add_argument("version")
        common(p)
        who(p)
        if name == "reject":
            p.add_argument("--reason", required=True)
        p.set_defaults(fn=cmd_decide)
    rb = rs.add_parser("rollback", help="deploy an earlier deployed version again (the next round trains from it)")
    rb.add_argument("version")
    common(rb)
    who(rb)
    rb.set_defaults(fn=cmd_rollback)
    ec = rs.add_parser("end-canary", help="end a running canary now: --promote (every replica) or --fail (removed)")
    ec.add_argument("version")
    how = ec.add_mutually_exclusive_group(required=True)
    how.add_argument("--promote", action="store_true")
    how.add_argument("--fail", action="store_true")
    common(ec)
    who(ec)
    ec.set_defaults(fn=cmd_end_canary)
