"""One prod-RL round as a chain of partitioned assets: each calls its step in ``loop`` and that step's
lineage hook (``loop.lineage_hooks``), then reports metadata."""

from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, PipesSubprocessClient

from prodrl_pipelines.loop import promotion
from prodrl_pipelines.loop import data
from prodrl_pipelines.loop import export
from prodrl_pipelines.loop import gate
from prodrl_pipelines.loop import lineage_hooks
from prodrl_pipelines.assets.partitions import ACTION_TAG, AT_TAG, BY_TAG, MODEL_VERSION_TAG, round_asset
from prodrl_pipelines.ops.ray_scoring import score_round_step
from prodrl_pipelines.ops.ray_eval import heldout_eval_op
from prodrl_pipelines.ops.training import train_op
from prodrl_pipelines.loop.phases import PhaseMeter
from prodrl_pipelines.loop.plots import markdown_image
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, open_services



@round_asset(kinds={"delta"})
def scored_rewards(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                   mlflow: MlflowResource) -> MaterializeResult:
    """Rewards for the window's recorded trajectories that lack one from the configured scorers
    (grader, judge): only what is missing is scored; a failure leaves the trajectory pending, counted."""
    svc = open_services(settings, store, mlflow)
    stats = score_round_step(context, settings, store, svc)  # a Ray Data job on a Ray cluster with scoring workers
    meta = {"rule": stats["rule"], "trajectories": stats["trajectories"], "in_flight": stats["in_flight"]}
    for name, r in stats["sources"].items():
        meta.update({f"{name}_{k}": r[k] for k in ("version", "scored", "already", "skipped", "pending", "failed",
                                                     "in_flight")})
        meta[f"{name}_reward_mean"] = r["reward_mean"]
        if r["first_error"]:
            meta[f"{name}_first_error"] = r["first_error"]
            context.log.warning(f"{name}: {r['failed']} trajectories failed to score (left pending); first error: "
                                f"{r['first_error']}")
    if stats["sources"]:
        rec = lineage_hooks.record_scoring(svc, context.partition_key, stats)
        meta["reward_distribution"] = MetadataValue.md(markdown_image(rec["png"], "scored rewards"))
        meta["mlflow_run"] = MetadataValue.url(svc.lineage.run_url(rec["run_id"]))
    return MaterializeResult(metadata=meta)


@round_asset(deps=[scored_rewards], kinds={"parquet"})
def recorded_trajectories(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource) -> MaterializeResult:
    """S*B valid, rewarded trajectories from the live policy (within max_policy_lag), each used once;
    bad records are quarantined and counted."""
    stats = data.select_data(open_services(settings, store), context.partition_key)
    return MaterializeResult(metadata={
        "num_trajectories": stats["num_trajectories"], "num_calls": stats["num_calls"],
        "generated_tokens": stats["generated_tokens"], "eligible": stats["eligible"],
        "quarantined": stats["quarantined"], "quarantine_reasons": MetadataValue.json(stats["quarantine_reasons"]),
        "reward_mean": stats["reward_mean"], "reward_std": stats["reward_std"], "reward_sources": stats["reward_sources"],
        "live_version": stats["live_version"], "data_versions": MetadataValue.json(stats["data_versions"]),
        "table_versions": MetadataValue.json(stats["table_versions"]),  # the pinned store snapshot
        # replay mode, and with the retokenized baseline how many calls' ids differ from the recorded ones
        **{k: v for k, v in stats.items() if k == "replay" or k.startswith("retokenized_")},
    })


@round_asset(deps=[recorded_trajectories])
def training_batch(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource) -> MaterializeResult:
    """Advantages (recipe baseline) and the S minibatches of B trajectories."""
    stats = data.build_batch(open_services(settings, store), context.partition_key)
    return MaterializeResult(metadata=stats)


@round_asset(deps=[training_batch], kinds={"pytorch"})
def trained_checkpoint(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                       mlflow: MlflowResource, pipes: PipesSubprocessClient) -> MaterializeResult:
    """theta_{k+1}: S Adam steps from the live checkpoint theta_k (Adam state carried over);
    in-process, `torchrun` with `train_processes` ranks, or Ray Train (`cluster: ray`), through Dagster Pipes."""
    svc = open_services(settings, store, mlflow)
    rkey = context.partition_key
    run_id = lineage_hooks.training_run(svc, rkey)

    def on_step(step: int, m: dict) -> None:
        svc.lineage.log_metrics(run_id, m, step)

    stats = train_op(context, svc, rkey, settings.train_processes, settings.fields(),
                     {k: getattr(store, k) for k in type(store).model_fields}, pipes, on_step,
                     cluster=settings.cluster_config())
    rec = lineage_hooks.record_training(svc, rkey, run_id, stats)
    stats.pop("steps")
    return MaterializeResult(metadata={
        **stats, **rec["means"], "correction": svc.settings.recipe.correction, "mlflow_run_id": run_id,
        "mlflow_run": MetadataValue.url(svc.lineage.run_url(run_id)),
        "mismatch_plot": MetadataValue.md(markdown_image(rec["png"], "mismatch")),
        **({"routing_plot": MetadataValue.md(markdown_image(rec["routing_png"], "routing"))} if rec["routing_png"] else {}),
    })


@round_asset(deps=[trained_checkpoint], kinds={"safetensors"})
def exported_policy(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                    mlflow: MlflowResource) -> MaterializeResult:
    """The deployable export of theta_{k+1} (NVFP4 compressed-tensors by default), registered as the
    `challenger` model version; non-finite weights are refused here, naming the tensor."""
    from prodrl_pipelines.quant.export import layer_error_markdown

    svc = open_services(settings, store, mlflow)
    rkey = context.partition_key
    stats = export.export(svc, rkey)
    rec = lineage_hooks.record_export(svc, rkey, stats)
    png, version = rec["png"], rec["version"]
    smoke = stats["smoke"]
    smoke_md = "\n".join(f"- `{x['prompt'][-60:]!r}` -> `{x['output']!r}` (mean log mu {x['mean_logprob']:.3f})"
                         for x in smoke["samples"]) or f"smoke generation failed: {smoke['error']}"
    return MaterializeResult(metadata={
        "scheme": stats["scheme"], "format": stats["format"], "model_version": version,
        "export_dir": MetadataValue.path(stats["export_dir"]),
        "source_bytes": stats["source_bytes"], "bf16_bytes": stats["bf16_bytes"], "export_bytes": stats["export_bytes"],
        "compression_ratio": stats["compression_ratio"], "compression_ratio_vs_source": stats["compression_ratio_vs_source"],
        "quantized_tensors": stats["quantized_tensors"], "max_rel_fro_error": stats["max_rel_fro_error"],
        "mean_rel_fro_error": stats["mean_rel_fro_error"], **stats["phases"],
        "layer_errors": MetadataValue.md(layer_error_markdown(stats["layers"])),
        "layer_error_plot": MetadataValue.md(markdown_image(png, "relative Frobenius error per tensor")),
        "smoke_generation": MetadataValue.md(smoke_md), "smoke_error": smoke["error"] or "none",
    })


@round_asset(deps=[exported_policy])
def heldout_eval(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                 mlflow: MlflowResource) -> MaterializeResult:
    """Held-out reward of the candidate export and of the live deployment on the same tasks (in-process,
    or sharded over Ray workers with `cluster: ray` and `cluster_eval_workers`). Once the round's gate
    has decided, re-running it reproduces the recorded evaluation (nothing is re-judged)."""
    svc = open_services(settings, store, mlflow)
    rkey = context.partition_key
    meter = PhaseMeter()
    with meter.phase("evaluate"):
        res = heldout_eval_op(context, svc, rkey, settings.cluster_config(), settings.fields(),
                              {k: getattr(store, k) for k in type(store).model_fields})
    run_id = lineage_hooks.record_evaluation(svc, rkey, res)
    cand = res["candidate"]
    return MaterializeResult(metadata={
        "candidate_reward": cand["mean"] if cand else float("nan"),
        "candidate_ci95": cand["ci95"] if cand else float("nan"),
        "live_reward": res["live"]["mean"], "live_version": res["live_version"],
        "num_tasks": len(res["live"]["rewards"]), "heldout_size": svc.settings.eval.heldout_size,
        "smoke_error": res["smoke_error"] or "none",
        "monitors": MetadataValue.md(monitor_table(res.get("monitors") or [])),
        "suite": svc.suite.name, "reward_errors": cand.get("reward_errors", 0) if cand else 0,
        "first_reward_error": (cand.get("first_reward_error") or "none") if cand else "none",
        # the paired test the gate applies next (it also checks the weights)
        "verdict": gate.heldout_verdict(svc, res).summary(), "reproduced": res["reproduced"],
        "mlflow_run": MetadataValue.url(svc.lineage.run_url(run_id)), **meter.metadata(),
    })


def monitor_table(monitors: list[dict]) -> str:
    if not monitors:
        return "no behaviour monitors recorded"
    rows = ["| monitor | verdict | value | threshold | detail |", "|---|---|---|---|---|"]
    for m in monitors:
        verdict = "passed" if m["passed"] else ("**blocks**" if m["blocking"] else "warning")
        rows.append(f"| {m['name']} | {verdict} | {m['value']:.4g} | {m['threshold']:.4g} | {m['detail']} |")
    return "\n".join(rows)


@round_asset(deps=[heldout_eval], output_required=False)
def deployment(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
               mlflow: MlflowResource):
    """Redeploy through the deploy target: the new export serves, passes its health check and parity
    probe, then becomes the live policy and the registry `champion`. With `promotion: review` a round
    run leaves it pending (no materialisation) until the registry sensor's run for the reviewer's
    approval or rollback. A failed probe rolls back (the previous version keeps serving), tags the
    model version and fails this asset. The latest materialisation is the "currently live" marker."""
    from prodrl_pipelines.deploy_targets.rollout import DeployRejected
    from prodrl_pipelines.loop.round_state import describe_decision

    svc = open_services(settings, store, mlflow)
    rkey = context.partition_key
    tags = context.run.tags
    version = tags.get(MODEL_VERSION_TAG) or svc.ledger.round_summary(rkey).get("model_version")
    request = (promotion.DeployRequest(tags[ACTION_TAG], tags.get(BY_TAG, ""), tags.get(AT_TAG, ""))
               if ACTION_TAG in tags else None)
    try:
        out = promotion.deploy(svc, rkey, model_version=version, request=request)
    except DeployRejected as e:
        probe = lineage_hooks.numeric(e.probe.metrics()) if e.probe is not None else {}
        lineage_hooks.record_deploy_rejected(svc, rkey, version, request, probe, e)
        raise Failure(description=f"{rkey} was not deployed: {e}",
                      metadata={"reason": e.reason, "rolled_back": e.rollback, **probe}) from e
    except Exception:
        if request is not None and request.kind == "rollback":  # champion names what serves, not the request
            lineage_hooks.champion_to_live(svc)
        raise
    if out.kind == "canary":  # on a slice of live traffic; the canary sensor promotes or removes it
        lineage_hooks.record_canary(svc, rkey, version, "running")
        context.log.info(f"{rkey} is a canary on {svc.settings.deploy.canary_fraction:.0%} of trajectories until "
                         f"{svc.settings.deploy.canary_min_trajectories} of them are rewarded")
        return
    if out.kind == "awaiting_review":
        context.log.info(f"{rkey} awaits review: {describe_decision(svc.ledger.decision(rkey))}; model version "
                         f"{version} is `challenger` with review=pending (approve: move `champion` to it or "
                         f"`prodrl review approve {version}`)")
        return
    dep = out.live
    meta = out.rollout.metadata() if out.rollout is not None else {}
    lineage_hooks.record_deployment(svc, rkey, version, request, out, meta)
    if request is not None and request.kind == "canary_promote":
        from prodrl_pipelines.loop import canary

        lineage_hooks.record_canary(svc, rkey, version, "passed",
                                    canary.CanaryVerdict(**svc.ledger.decision(rkey)["canary_verdict"]))
    yield MaterializeResult(metadata={
        "policy_version": dep.policy_version, "live": True, "how": out.kind if out.kind != "reproduced" else dep.kind,
        "rollback": dep.kind == "rollback", "decided_by": dep.decided_by or "unknown", "deployed_at": dep.deployed_at,
        "export_dir": dep.export_dir, "reproduced": out.kind == "reproduced",
        "model_version": MetadataValue.url(svc.lineage.version_url(version)) if version else "none",
        **({"endpoint": MetadataValue.url(meta["endpoint"]) if meta.get("endpoint") else "none"} if meta else {}),
        **{k: v for k, v in meta.items() if k != "endpoint"}})
