"""The sensors of the loop.

- ``data_volume_sensor`` starts round k+1 when round k is decided and S*B eligible trajectories exist.
- ``registry_sensor`` polls the MLflow registry and turns a reviewer's edits into runs: an approval
  (alias ``champion`` moved to a pending version, or tag ``review=approved``) and a rollback (``champion``
  moved to an older deployed version) each become a run of ``registry_decision`` (the `deployment`
  asset of that round); a rejection closes the round at once; anything contradictory is refused on
  the version and in the skip reason.
- ``canary_sensor`` has the canary window's complete trajectories scored with the plan's scorers by
  a run of ``canary_scoring`` (one at a time; the tick itself never scores, so a hung judge cannot
  hold it) and judges a running canary on the rewards a round would train on (or a reviewer's early end: tag
  ``canary_end=promote|fail`` on its version, ``prodrl review end-canary``): a pass is recorded and
  becomes a run of ``registry_decision`` that rolls the candidate out to every replica; a failure
  removes the canary at once (the round is decided, not deployed). A recorded pass is final.
"""

import hashlib
import json

from dagster import (
    AssetSelection, DagsterRunStatus, DefaultSensorStatus, RunRequest, RunsFilter, SensorEvaluationContext,
    SensorResult, SkipReason, define_asset_job, in_process_executor, sensor,
)

from prodrl_pipelines.config import environment
from prodrl_pipelines.loop import review
from prodrl_pipelines.loop import schedule
from prodrl_pipelines.assets.partitions import (
    ACTION_TAG, AT_TAG, BY_TAG, MODEL_VERSION_TAG, ROUND_TAG, rounds_partitions,
)
from prodrl_pipelines.assets.round import deployment
from prodrl_pipelines.ops.canary_scoring import canary_scoring_job
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, open_services

# A round is a chain: its steps run one after another in the run's own process (a process per step
# would only add a Python start-up and imports per step); training ranks are launched by Pipes.
round_job = define_asset_job(
    "prod_rl_round",
    selection=AssetSelection.groups("prod_rl_round"),
    partitions_def=rounds_partitions,
    tags={ROUND_TAG: "train"},
    executor_def=in_process_executor,
    description="One prod-RL round: score -> select -> batch -> train -> export -> evaluate -> gate -> deploy.",
)
registry_decision_job = define_asset_job(
    "registry_decision",
    selection=[deployment],
    partitions_def=rounds_partitions,
    tags={ROUND_TAG: "train"},  # queued behind a round in flight, never beside it
    executor_def=in_process_executor,
    description="A reviewer's decision from the MLflow registry: deploy an approved round, or roll back.",
)

RUN_KEY_TAG = "dagster/run_key"  # what Dagster tags a sensor's run with
IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


@sensor(job=round_job, minimum_interval_seconds=environment.sensor_interval_s(),
        default_status=DefaultSensorStatus.RUNNING)
def data_volume_sensor(context: SensorEvaluationContext, settings: ProdRLSettings, store: StoreResource):
    """Adds the next `rounds` partition and requests its run in one tick (run_key = partition key)."""
    existing = context.instance.get_dynamic_partitions(rounds_partitions.name)
    in_flight = any(context.instance.get_run_records(RunsFilter(job_name=job.name, statuses=IN_FLIGHT), limit=1)
                    for job in (round_job, registry_decision_job))
    key, reason = schedule.next_round_decision(open_services(settings, store), existing, in_flight)
    if key is None:
        return SkipReason(reason)
    context.log.info(f"starting {key}: {reason}")
    return SensorResult(
        run_requests=[RunRequest(partition_key=key, run_key=key, tags={ROUND_TAG: "train"})],
        dynamic_partitions_requests=[rounds_partitions.build_add_request([key])],
    )


def _registry_digest(champion, versions, model_tags) -> str:
    state = [champion, sorted(model_tags.items()),
             [(mv.version, sorted((k, v) for k, v in mv.tags.items())) for mv in versions]]
    return hashlib.sha256(json.dumps(state, default=str).encode()).hexdigest()[:16]


@sensor(job=registry_decision_job, minimum_interval_seconds=environment.registry_interval_s(),
        default_status=DefaultSensorStatus.RUNNING)
def registry_sensor(context: SensorEvaluationContext, settings: ProdRLSettings, store: StoreResource,
                    mlflow: MlflowResource):
    """Polls the registry (its state digest is the cursor) and acts on what reviewers changed."""
    from prodrl_pipelines.loop.lineage import CHAMPION

    svc = open_services(settings, store, mlflow)
    live = svc.ledger.live()
    if live is None:
        return SkipReason("no live deployment yet: nothing to review")
    lin = svc.lineage
    champion, versions, model_tags = lin.alias_version(CHAMPION), lin.versions(), lin.model_tags()
    digest = _registry_digest(champion, versions, model_tags)
    if context.cursor == digest:  # acted on at an earlier tick: no decision documents to read again
        return SkipReason(f"registry unchanged; live: {live.policy_version} (model version {live.model_version})")
    actions = review.registry_actions(svc, champion, versions)
    notes, requests, partitions = [], [], []
    n_events = len(svc.ledger.events())
    for a in actions:
        if a.kind == "refuse":
            review.apply_refusal(svc, a)
            notes.append(f"refused: {a.message}")
        elif a.kind == "reject":
            review.apply_rejection(svc, a)
            notes.append(f"{a.round} (model version {a.version}) rejected by {a.by}")
        else:
            key = a.run_key(n_events)
            if a.kind == "rollback":  # a failed rollback put champion back: moving it again is a new request
                key += "-" + str(len(context.instance.get_run_records(RunsFilter(
                    tags={ACTION_TAG: "rollback", MODEL_VERSION_TAG: a.version}, statuses=[DagsterRunStatus.FAILURE]))))
            earlier = context.instance.get_run_records(RunsFilter(tags={RUN_KEY_TAG: key}), limit=1)
            if earlier:  # requested at an earlier tick: say where it stands instead of asking again
                run = earlier[0].dagster_run
                hint = (f": re-execute run {run.run_id} to retry" if run.status == DagsterRunStatus.FAILURE else "")
                notes.append(f"{a.kind} of {a.round} (model version {a.version}): run {run.run_id[:8]} "
                             f"{run.status.value.lower()}{hint}")
                continue
            if a.round not in context.instance.get_dynamic_partitions(rounds_partitions.name):
                partitions.append(a.round)  # the base policy, rolled back to
            requests.append(RunRequest(partition_key=a.round, run_key=key, tags={
                ROUND_TAG: "train", ACTION_TAG: a.kind, BY_TAG: a.by, AT_TAG: a.at, MODEL_VERSION_TAG: a.version}))
            notes.append(f"{a.kind} {a.round} (model version {a.version}) requested by {a.by}")
    for n in notes:
        context.log.info(n)
    # The cursor is the state read at the start of this tick: a change made while it ran (a reviewer's
    # edit between our own rewrites and a re-read) changes the next digest and is not lost. Our own
    # refusals and rejections change it too, so the next tick evaluates once more and finds them
    # decided (the actions are idempotent).
    context.update_cursor(digest)
    if not requests:
        return SkipReason("; ".join(notes) or f"no pending decision in the registry; live: {live.policy_version}")
    return SensorResult(run_requests=requests, dynamic_partitions_requests=(
        [rounds_partitions.build_add_request(partitions)] if partitions else []))


_RUNNING = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
            DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


def _canary_scoring_request(context: SensorEvaluationContext, svc, rkey: str) -> RunRequest | None:
    """A run of ``canary_scoring`` for ``rkey`` unless one is queued or running, or the last one ended
    less than ``deploy.canary_scoring_every_s`` ago (none without scorers). Its run key counts the
    round's scoring runs, so a tick evaluated twice asks for the same run."""
    import time

    from prodrl_pipelines.ops.canary_scoring import CANARY_SCORING_JOB, SCORING_TAG

    if not svc.settings.rewards.scorers:
        return None
    mine = RunsFilter(job_name=CANARY_SCORING_JOB, tags={SCORING_TAG: rkey})
    last = context.instance.get_run_records(mine, limit=1)
    if last and (last[0].dagster_run.status in _RUNNING or (
            last[0].end_time and time.time() - last[0].end_time < svc.settings.deploy.canary_scoring_every_s)):
        return None
    n = context.instance.get_runs_count(mine)
    return RunRequest(job_name=CANARY_SCORING_JOB, partition_key=rkey, run_key=f"canary_score-{rkey}-{n + 1}",
                      tags={SCORING_TAG: rkey})


@sensor(jobs=[registry_decision_job, canary_scoring_job], minimum_interval_seconds=environment.registry_interval_s(),
        default_status=DefaultSensorStatus.RUNNING)
def canary_sensor(context: SensorEvaluationContext, settings: ProdRLSettings, store: StoreResource,
                  mlflow: MlflowResource):
    """Promotes a canary that is as good as the champion on live reward, removes one that is worse.
    With scorers in the plan, a ``canary_scoring`` run grades the window's complete trajectories (one
    at a time); the tick judges what is recorded. A pass is recorded before its rollout is requested
    and is final: later ticks only ask again for the same run (its run key)."""
    from prodrl_pipelines.loop import canary, lineage_hooks
    from prodrl_pipelines.loop.review import UNKNOWN_REVIEWER

    svc = open_services(settings, store, mlflow)
    rkey = canary.running_canary(svc)
    if rkey is None:
        return SkipReason("no canary running")
    version = svc.ledger.round_summary(rkey).get("model_version")
    key = f"canary_promote-{rkey}"
    requested = bool(context.instance.get_run_records(RunsFilter(tags={RUN_KEY_TAG: key}), limit=1))
    verdict = canary.acted_verdict(svc, rkey)
    if verdict is None and not requested:
        # what the last scoring run could not score (a hung judge: its breaker opened, its budget ran out)
        scoring = canary.scoring_summary(canary.last_scoring(svc, rkey))
        tags = svc.lineage.version_tags(version) if version else {}
        verdict = canary.judge(svc, rkey)
        by = "canary (live reward)"
        if tags.get(canary.END_TAG) in ("promote", "fail"):  # a reviewer ends it early
            by = tags.get(canary.END_BY_TAG) or UNKNOWN_REVIEWER
            verdict.passed, verdict.ended_by = tags[canary.END_TAG] == "promote", f"ended early by {by}"
        elif (why := canary.paused(svc)) is not None:  # the recorder took a crashed canary off traffic
            waited, grace = canary.paused_for_s(svc), float(svc.settings.deploy.canary_pause_grace_s)
            if waited < grace:  # a restart is a blip: the recorder resumes a canary that answers again
                return SkipReason(f"{rkey} canary: verdict waits, paused by the recorder {waited:.0f} s ago "
                                  f"({why}); failed after {grace:.0f} s unless its server answers again")
            by = "recorder (canary paused)"
            verdict.passed, verdict.ended_by = False, f"paused by the recorder: {why}"
        if verdict.passed is None:
            if version and tags.get("canary_trajectories") != str(verdict.n_candidate):
                lineage_hooks.record_canary(svc, rkey, version, "running", verdict)  # the numbers so far
            why = f"{rkey} canary: {verdict.summary()}" + (f"; scoring: {scoring}" if scoring else "")
            scoring_run = _canary_scoring_request(context, svc, rkey)  # only while the verdict waits on rewards
            if scoring_run is not None:
                context.log.info(f"{why}; scoring its window ({scoring_run.run_key})")
                return scoring_run
            return SkipReason(why)
        if not verdict.passed:
            canary.fail(svc, rkey, verdict, by)
            lineage_hooks.record_canary(svc, rkey, version, "failed", verdict)
            lineage_hooks.champion_to_live(svc)
            context.log.info(verdict.summary())
            return SkipReason(f"{rkey}: {verdict.summary()}; removed, the champion serves every trajectory")
        verdict = canary.record_promotion(svc, rkey, verdict, by)  # final from here on
    if requested:
        return SkipReason(f"{rkey}: {verdict.summary() if verdict else 'promotion'}; its rollout was requested")
    acted = canary.promotion_by(svc, rkey)
    context.log.info(verdict.summary())
    return RunRequest(job_name=registry_decision_job.name, partition_key=rkey, run_key=key, tags={
        ROUND_TAG: "train", ACTION_TAG: "canary_promote", BY_TAG: acted["by"], AT_TAG: acted["at"],
        MODEL_VERSION_TAG: version or ""})
