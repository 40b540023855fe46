"""Scoring and re-scoring as Ray jobs: the steps that run on the cluster (``ray_jobs.STEPS``: ``score``,
``rescore``) and the Dagster side that launches them (``scored_rewards``, ``rescore_rewards_job``).

With ``cluster: ray`` and ``cluster_scoring_workers`` above 0 the step's work runs as a Ray job whose
driver reads the window through the store, scores on a Ray Data actor pool of that many scorers
(``rewards.ray_scoring``) and writes the rows in one commit with an application transaction
(``rewards.scoring``); otherwise the step scores in its own process, as before. The job's driver
imports neither Dagster nor this module's launch half.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from prodrl_pipelines.loop import scoring


# --- on the cluster: the job's driver ------------------------------------------------------------

def _job_services():
    """The services and the runner of a job, from its ``PRODRL_*`` variables (``cluster.jobs``)."""
    from prodrl_pipelines.cluster.config import cluster_settings
    from prodrl_pipelines.config import environment
    from prodrl_pipelines.loop.services import services_from_env
    from prodrl_pipelines.rewards.runners import Runner

    cluster = cluster_settings(environment.read_settings())
    return services_from_env(), Runner("ray", max(1, cluster.cluster_scoring_workers))


def score_job(argv: list[str]) -> dict:
    """``score [ROUND]``: score what the live window lacks (for ``ROUND``: its scoring, stored beside
    it); returns the counts (the rewards themselves are in the round's document)."""
    svc, runner = _job_services()
    stats = scoring.score_round(svc, argv[0], runner) if argv else scoring.score_missing_now(svc, runner=runner)
    return {k: v for k, v in stats.items() if k != "rewards"}


def rescore_job(argv: list[str]) -> dict:
    """``rescore SOURCE [--versions V ...]``: the ``RescoreReport`` as a dict."""
    ap = argparse.ArgumentParser(prog="ray_jobs rescore")
    ap.add_argument("source")
    ap.add_argument("--versions", nargs="*", default=None)
    a = ap.parse_args(argv)
    svc, runner = _job_services()
    return asdict(scoring.rescore(svc, a.source, a.versions or None, runner))


# --- in the Dagster step: launch the job, or score here ---------------------------------------------

def _store_fields(store) -> dict:
    return {k: getattr(store, k) for k in type(store).model_fields}


def score_round_step(context, settings, store, svc) -> dict:
    """``loop.scoring.score_round`` of the step's round: as a Ray job on a ``ray`` cluster with scoring
    workers, else here. Returns the round's scoring document either way."""
    from prodrl_pipelines.rewards.runners import runner_for

    rkey, cluster = context.partition_key, settings.cluster_config()
    if runner_for(cluster).name != "ray":
        return scoring.score_round(svc, rkey)
    from prodrl_pipelines.ops.ray_launch import run_ray_step
    from prodrl_pipelines.storage import documents, keys

    run_ray_step(context, cluster, "score", [rkey], settings.fields(), _store_fields(store), f"score-{rkey}")
    return documents.get_json(svc.blobs, keys.scoring(rkey))


def rescore_step(context, settings, store, source: str, versions: list[str] | None):
    """``loop.scoring.rescore``: as a Ray job on a ``ray`` cluster with scoring workers, else here."""
    from prodrl_pipelines.resources.settings import open_services
    from prodrl_pipelines.rewards.runners import runner_for
    from prodrl_pipelines.rewards.scoring import RescoreReport

    cluster = settings.cluster_config()
    if runner_for(cluster).name != "ray":
        return scoring.rescore(open_services(settings, store), source, versions)
    from prodrl_pipelines.ops.ray_launch import run_ray_step

    args = [source] + (["--versions", *versions] if versions else [])
    out = run_ray_step(context, cluster, "rescore", args, settings.fields(), _store_fields(store), f"rescore-{source}")
    return RescoreReport(**out)
