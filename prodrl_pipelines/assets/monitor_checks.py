"""The behaviour monitors as asset checks on `heldout_eval`, one per monitor: each reads what the
round's evaluation recorded (``evaluation.monitors``), against live (per round) and against the
reference policy (cumulative) side by side; a blocking monitor's failure in either is an ERROR and
also one of the deployment gate's reasons, a warning monitor's is a WARN."""

from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, multi_asset_check

from prodrl_pipelines.assets.partitions import rounds_partitions
from prodrl_pipelines.assets.round import heldout_eval
from prodrl_pipelines.evaluation.monitors import MONITORS
from prodrl_pipelines.loop.services import upstream_json
from prodrl_pipelines.resources.settings import ProdRLSettings, StoreResource, open_services
from prodrl_pipelines.storage import keys

_DESCRIPTIONS = {
    "format_errors": "Candidate vs live rate of calls with a format or tool-call parse error.",
    "length_drift": "Relative change of the mean generated tokens per held-out episode.",
    "refusal_rate": "Candidate vs live rate of refusals and clarifying questions (pattern).",
    "kl": "KL(candidate || live) per generated token on the held-out prompts (sampled-token estimator).",
    "slices": "Held-out reward per task tag: the paired lower bound on each slice against the gate tolerance.",
}


@multi_asset_check(
    specs=[AssetCheckSpec(name=f"monitor_{n}", asset=heldout_eval, partitions_def=rounds_partitions,
                          description=_DESCRIPTIONS.get(n, n)) for n in MONITORS],
    can_subset=True,
    description="Behaviour monitors beside the reward (the gate counts the blocking ones).",
)
def behaviour_monitors(context: AssetCheckExecutionContext, settings: ProdRLSettings, store: StoreResource):
    svc = open_services(settings, store)
    ev = upstream_json(svc, keys.heldout(context.partition_key))
    recorded = {m["name"]: m for m in ev.get("monitors") or []}
    cumulative = {m["name"]: m for m in ev.get("cumulative_monitors") or []}
    for key in context.selected_asset_check_keys:
        name = key.name.removeprefix("monitor_")
        m = recorded.get(name)
        if m is None:
            why = "disabled in monitors_enabled" if name not in svc.settings.monitors.enabled else \
                "not recorded (the candidate failed to serve, or the evaluation predates the monitor)"
            yield AssetCheckResult(check_name=key.name, passed=True, severity=AssetCheckSeverity.WARN,
                                   description=f"{name}: {why}", metadata={"recorded": False})
            continue
        yield _result(key.name, m, cumulative.get(name), ev.get("reference_version"))


def _verdict(m: dict) -> str:
    return "passed" if m["passed"] else ("blocks the deploy" if m["blocking"] else "warning")


def _result(check: str, m: dict, c: dict | None, reference: str | None) -> AssetCheckResult:
    """Per round (vs live) and cumulative (vs the reference policy) in one check, side by side."""
    parts = [m] + ([c] if c else [])
    failing = [p for p in parts if not p["passed"]]
    meta = {"value": m["value"], "threshold": m["threshold"], "blocking": m["blocking"], "verdict": _verdict(m)}
    desc = m["detail"]
    if c is not None:
        meta.update({"cumulative_value": c["value"], "cumulative_threshold": c["threshold"],
                     "cumulative_verdict": _verdict(c), "reference_version": reference or c.get("against", "")})
        desc += f" | cumulative vs reference {reference or c.get('against', '')}: {c['detail']}"
    return AssetCheckResult(
        check_name=check, passed=not failing,
        severity=AssetCheckSeverity.ERROR if m["blocking"] else AssetCheckSeverity.WARN,  # one switch for both
        description=desc, metadata=meta)
