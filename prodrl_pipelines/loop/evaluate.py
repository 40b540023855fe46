"""Step 5 of a round: the candidate and the live policy on the same held-out tasks; and
re-evaluations of any deployed version, stored beside the original."""

from __future__ import annotations

from pathlib import Path

from prodrl_pipelines.loop.services import RoundError, Services, ensure_local, refuse_if_decided, upstream_json
from prodrl_pipelines.storage import documents, keys


def evaluate_export(svc: Services, export_dir: Path, policy_version: str, keep_calls: bool = False) -> dict:
    """Held-out reward per task of one exported policy on the suite, served as the deployment would."""
    from prodrl_pipelines.evaluation import evaluate_policy as _evaluate

    return _evaluate(svc.settings, svc.suite, export_dir, policy_version, keep_calls=keep_calls,
                     runner=svc.episode_runner)


def reference_version(svc: Services) -> str:
    """The cumulative monitors' reference: the newest deployed version a person approved in review
    (and not rolled back away from since), else round 0. It moves only when someone reviews."""
    from prodrl_pipelines.loop.round_state import BASE_VERSION

    events = svc.ledger.events()
    left = {e.get("previous") for e in events if e.get("kind") == "rollback"}
    for e in reversed(events):
        v = e["policy_version"]
        if v != BASE_VERSION and v not in left and (svc.ledger.decision(v) or {}).get("review") == "approved":
            return v
    return BASE_VERSION


def version_eval(svc: Services, policy_version: str, task_ids: list | None = None) -> dict:
    """A deployed version's recorded held-out evaluation with per-episode facts, on ``task_ids``;
    evaluated (and recorded) again when it is missing, predates the facts or ran other tasks."""
    from prodrl_pipelines.evaluation.statistics import same_tasks

    ev = svc.ledger.eval(policy_version)
    if ev is None or "facts" not in ev or (task_ids is not None and not same_tasks(ev, task_ids)):
        ev = evaluate_export(svc, ensure_local(svc, "exports", policy_version), policy_version)
        svc.ledger.record_eval(policy_version, ev)
    return ev if task_ids is None else _paired(ev, task_ids)


def _paired(ev: dict, task_ids: list) -> dict:
    """``ev`` keyed by task to ``task_ids`` (``paired_on``), or a RoundError saying what differs."""
    from prodrl_pipelines.evaluation.statistics import UnpairedEvaluations, paired_on

    try:
        return paired_on(ev, task_ids)
    except UnpairedEvaluations as e:
        raise RoundError(f"{e}; the suite must play the same held-out tasks for every policy (a served "
                         "harness: the same task ids for the same seed and size)") from None


# Ray's errors that say the cluster lost something (a node, a worker, an actor's owner, an object),
# not that the code it ran failed
_INFRASTRUCTURE = ("NodeDiedError", "WorkerCrashedError", "ObjectLostError", "RaySystemError",
                   "ActorUnavailableError", "OutOfMemoryError")


def infrastructure_failure(e: BaseException) -> bool:
    """An evaluation that failed because the cluster lost a node, worker or actor, not because the
    candidate cannot serve: deciding the round on it would fail a good candidate (and consume its
    data). An actor whose own start raised (the export does not load) is the candidate's failure."""
    import sys

    if "ray" not in sys.modules:
        return False
    from ray.exceptions import RayActorError

    if isinstance(e, RayActorError):
        return not e.actor_init_failed
    return any(cls.__name__ in _INFRASTRUCTURE and cls.__module__.startswith("ray") for cls in type(e).__mro__)


def kl_to_reference(svc: Services, calls: list, reference_export: Path) -> dict:
    """KL(candidate || reference) per generated token on the candidate's own held-out calls: the
    sampled-token estimator mean(log pi_cand(a) - log pi_ref(a)) with a ~ pi_cand, both processed by
    the deployment's sampling settings. Tokens the reference could never sample (outside its top-k /
    top-p support) are counted apart: the KL over them is infinite."""
    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.evaluation.monitors import sampled_token_kl

    calls = [c for c in calls if c[1]]
    if not calls:
        return {}
    ref = LocalEngine.from_pretrained(reference_export)
    ref_lp = ref.score([c[0] for c in calls], [c[1] for c in calls], svc.settings.deploy.sampling())
    kl, n, outside = sampled_token_kl([x for c in calls for x in c[2]], [x for r in ref_lp for x in r])
    return {"kl_to_live": kl, "kl_tokens": n, "kl_outside_live_support": outside}


def evaluate(svc: Services, rkey: str) -> dict:
    """The candidate and the live policy on the same held-out tasks, paired by task id. Once the gate has decided, the
    recorded evaluation is returned as it is (``reproduced``): a later live policy never re-judges it."""
    if svc.ledger.decision(rkey) is not None:
        if svc.blobs.exists(keys.heldout(rkey)):
            return {**upstream_json(svc, keys.heldout(rkey)), "reproduced": True}
        refuse_if_decided(svc, rkey, "heldout_eval")  # decided before any evaluation (e.g. at export)
    from prodrl_pipelines.evaluation.statistics import same_tasks

    live = svc.live()
    export_dir = ensure_local(svc, "exports", rkey)
    # the live export where its deploy recorded it, fetched when this machine (a Ray job's node) lacks it
    live_dir = ensure_local(svc, "exports", live.policy_version, Path(live.export_dir))
    cand, smoke_error = None, ""
    calls: list = []
    try:
        cand = evaluate_export(svc, export_dir, rkey, keep_calls=True)
        calls = cand.pop("calls")
    except Exception as e:  # noqa: BLE001 - a candidate that cannot serve is a gate failure, not a crash
        if infrastructure_failure(e):  # not the candidate's doing: the step fails and is retried
            raise
        smoke_error = f"{type(e).__name__}: {e}"
    live_eval = svc.ledger.eval(live.policy_version)
    if (live_eval is None or "facts" not in live_eval
            or (cand is not None and not same_tasks(live_eval, cand["task_ids"]))):
        live_eval = evaluate_export(svc, live_dir, live.policy_version)
        svc.ledger.record_eval(live.policy_version, live_eval)
    if cand is not None:  # paired by task, not by the order a harness reported them in
        live_eval = _paired(live_eval, cand["task_ids"])
    monitors, cumulative, ref = [], [], None
    if cand is not None:
        mon = svc.settings.monitors
        if "kl" in mon.enabled:
            cand.update(kl_to_reference(svc, calls, live_dir))
        from prodrl_pipelines.evaluation.monitors import run_monitors

        monitors = [m.as_dict() for m in run_monitors(cand, live_eval, mon, svc.settings.eval.gate_tolerance,
                                                       svc.settings.eval.gate_z, against=live.policy_version)]
        if mon.cumulative:
            ref = reference_version(svc)
            ref_eval = live_eval if ref == live.policy_version else version_eval(svc, ref, cand["task_ids"])
            kl_ref = None
            if "kl" in mon.enabled and ref != live.policy_version:
                # no scored tokens: "not measured", never the KL to live in its place
                kl_ref = kl_to_reference(svc, calls, ensure_local(svc, "exports", ref)) or {"kl_to_live": None}
                cand["kl_to_reference"] = {"policy_version": ref, **kl_ref}
            cumulative = [m.as_dict() for m in run_monitors(
                cand, ref_eval, mon, svc.settings.eval.gate_tolerance, svc.settings.eval.gate_z,
                scope="cumulative", against=ref, kl_fields=kl_ref)]
        svc.ledger.record_eval(rkey, cand)
    result = {"candidate": cand, "live": live_eval, "smoke_error": smoke_error, "live_version": live.policy_version,
              "monitors": monitors, "reference_version": ref, "cumulative_monitors": cumulative}
    documents.put_json(svc.blobs, keys.heldout(rkey), result)
    result["reproduced"] = False
    if cand is not None:
        svc.ledger.update_round(rkey, heldout_reward=cand["mean"], heldout_reward_ci=cand["ci95"],
                                  live_heldout_reward=live_eval["mean"])
    return result


def evaluate_version(svc: Services, policy_version: str | None = None) -> dict:
    """Held-out reward of ``policy_version`` (default: the live one) on the suite, from its export."""
    live = svc.ledger.live()
    if policy_version is None:
        if live is None:
            raise RoundError("no live deployment: bootstrap first (`prodrl bootstrap`), or name --policy")
        policy_version = live.policy_version
    export_dir = ensure_local(svc, "exports", policy_version)
    if not (export_dir / "config.json").exists():
        raise RoundError(f"no export of {policy_version!r} at {export_dir}"
                         + ("" if svc.exports_store is None else f" nor in {svc.exports_store!r}"))
    ev = evaluate_export(svc, export_dir, policy_version)
    if policy_version.startswith("round-"):  # beside the round's own evaluation, never over it
        from prodrl_pipelines.loop.round_state import utc_now

        stamp = utc_now().replace(":", "").replace("+0000", "Z")
        key = keys.reevaluation(policy_version, stamp)
        documents.put_json(svc.blobs, key, {**ev, "evaluated_at": stamp, "suite": svc.suite.name,
                                          "live_version": live.policy_version if live else None})
        ev = {**ev, "stored_at": key}
    return ev
