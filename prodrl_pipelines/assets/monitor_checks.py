"""The behaviour monitors as asset checks on `heldout_eval`, one per monitor: each reads what the
round's evaluation recorded (``evaluation.monitors``); a blocking monitor's failure is an ERROR and
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
    for key in context.selected_asset_check_keys:
        name = key.name.removeprefix("monitor_")
        m = recorded.get(name)
        if m is None:
            why = "disabled in monitors_enabled" if name not in svc.settings.monitors.enabled else \
                "not recorded (the candidate failed to serve, or the evaluation predates the monitor)"
            yield AssetCheckResult(check_name=key.name, passed=True, severity=AssetCheckSeverity.WARN,
                                   description=f"{name}: {why}", metadata={"recorded": False})
            continue
        yield AssetCheckResult(
            check_name=key.name, passed=bool(m["passed"]),
            severity=AssetCheckSeverity.ERROR if m["blocking"] else AssetCheckSeverity.WARN,
            description=m["detail"],
            metadata={"value": m["value"], "threshold": m["threshold"], "blocking": m["blocking"],
                      "verdict": "passed" if m["passed"] else ("blocks the deploy" if m["blocking"] else "warning")})
