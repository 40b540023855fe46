"""One prod-RL round as a chain of partitioned assets; each calls one core step in `rounds`."""


from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, PipesSubprocessClient

from prodrl_pipelines import rounds
from prodrl_pipelines.assets.partitions import round_asset
from prodrl_pipelines.ops.training import train_op
from prodrl_pipelines.plots import markdown_image, mismatch_history_png, reward_curve_png
from prodrl_pipelines.resources.settings import MlflowResource, ProdRLSettings, StoreResource, services



@round_asset(kinds={"parquet"})
def recorded_trajectories(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource) -> MaterializeResult:
    """S*B valid, rewarded trajectories from the live policy (within max_policy_lag), each used once;
    bad records are quarantined and counted."""
    stats = rounds.select_data(services(settings, store), context.partition_key)
    return MaterializeResult(metadata={
        "num_trajectories": stats["num_trajectories"], "num_calls": stats["num_calls"],
        "generated_tokens": stats["generated_tokens"], "eligible": stats["eligible"],
        "quarantined": stats["quarantined"], "quarantine_reasons": MetadataValue.json(stats["quarantine_reasons"]),
        "reward_mean": stats["reward_mean"], "reward_std": stats["reward_std"],
        "live_version": stats["live_version"], "data_versions": MetadataValue.json(stats["data_versions"]),
        # replay mode, and with the retokenized baseline how many calls' ids differ from the recorded ones
        **{k: v for k, v in stats.items() if k == "replay" or k.startswith("retokenized_")},
    })


@round_asset(deps=[recorded_trajectories])
def training_batch(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource) -> MaterializeResult:
    """Advantages (recipe baseline) and the S minibatches of B trajectories."""
    stats = rounds.build_batch(services(settings, store), context.partition_key)
    return MaterializeResult(metadata=stats)


@round_asset(deps=[training_batch], kinds={"pytorch"})
def trained_checkpoint(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                       mlflow: MlflowResource, pipes: PipesSubprocessClient) -> MaterializeResult:
    """theta_{k+1}: S Adam steps from the live checkpoint theta_k (Adam state carried over);
    in-process, or `torchrun` with `train_processes` ranks through Dagster Pipes."""
    svc = services(settings, store, mlflow)
    rkey = context.partition_key
    run_id = svc.lineage.round_run(rkey, params={**svc.settings.recipe.model_dump(), **svc.settings.deploy.model_dump()})

    def on_step(step: int, m: dict) -> None:
        svc.lineage.log_metrics(run_id, m, step)

    stats = train_op(context, svc, rkey, settings.train_processes, settings.fields(),
                     {k: getattr(store, k) for k in type(store).model_fields}, pipes, on_step)
    steps = [m for m in stats.pop("steps") if not m.get("skipped")]
    history, starts = rounds.training_history(svc)
    png = mismatch_history_png(history, starts)
    svc.lineage.log_bytes(run_id, png, "mismatch.png", "plots")
    svc.lineage.log_metrics(run_id, {"round_mismatch_abs_logp": stats["mismatch_abs_logp"]}, stats["global_step"])
    means = {f"mean_{k}": float(sum(m[k] for m in steps) / len(steps))
             for k in ("engine_mismatch", "staleness", "staleness_steps", "net_mismatch", "kl", "head_entropy", "grad_norm",
                       "is_weight_mean", "is_truncated_frac", "ppo_clip_frac") if steps and k in steps[0]}
    return MaterializeResult(metadata={
        **stats, **means, "correction": svc.settings.recipe.correction, "mlflow_run_id": run_id, "mlflow_run": MetadataValue.url(svc.lineage.run_url(run_id)),
        "mismatch_plot": MetadataValue.md(markdown_image(png, "mismatch")),
    })


@round_asset(deps=[trained_checkpoint], kinds={"safetensors"})
def exported_policy(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                    mlflow: MlflowResource) -> MaterializeResult:
    """The deployable export of theta_{k+1} (NVFP4 compressed-tensors by default), registered as the
    `challenger` model version; non-finite weights are refused here, naming the tensor."""
    from pathlib import Path

    from prodrl_pipelines.quant.export import layer_error_markdown, layer_error_png

    svc = services(settings, store, mlflow)
    rkey = context.partition_key
    stats = rounds.export(svc, rkey)
    run_id = svc.lineage.round_run(rkey)
    png = layer_error_png(stats["layers"])
    svc.lineage.log_bytes(run_id, png, "export_layer_error.png", "plots")
    svc.lineage.log_metrics(run_id, {"export_compression_ratio": stats["compression_ratio"],
                                     "export_max_rel_fro_error": stats["max_rel_fro_error"]}, 0)
    version = svc.lineage.register_candidate(rounds.publish_export(svc, rkey, Path(stats["export_dir"])), run_id, rkey,
                                             {"format": stats["format"], "scheme": stats["scheme"], "gate": "pending"})
    svc.registry.update_round(rkey, model_version=version, mlflow_run_id=run_id)
    smoke = stats["smoke"]
    smoke_md = "\n".join(f"- `{x['prompt'][-60:]!r}` -> `{x['output']!r}` (mean log mu {x['mean_logprob']:.3f})"
                         for x in smoke["samples"]) or f"smoke generation failed: {smoke['error']}"
    return MaterializeResult(metadata={
        "scheme": stats["scheme"], "format": stats["format"], "model_version": version,
        "export_dir": MetadataValue.path(stats["export_dir"]),
        "source_bytes": stats["source_bytes"], "bf16_bytes": stats["bf16_bytes"], "export_bytes": stats["export_bytes"],
        "compression_ratio": stats["compression_ratio"], "compression_ratio_vs_source": stats["compression_ratio_vs_source"],
        "quantized_tensors": stats["quantized_tensors"], "max_rel_fro_error": stats["max_rel_fro_error"],
        "mean_rel_fro_error": stats["mean_rel_fro_error"],
        "layer_errors": MetadataValue.md(layer_error_markdown(stats["layers"])),
        "layer_error_plot": MetadataValue.md(markdown_image(png, "relative Frobenius error per tensor")),
        "smoke_generation": MetadataValue.md(smoke_md), "smoke_error": smoke["error"] or "none",
    })


@round_asset(deps=[exported_policy])
def heldout_eval(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
                 mlflow: MlflowResource) -> MaterializeResult:
    """Held-out reward of the candidate export and of the live deployment on the same tasks."""
    svc = services(settings, store, mlflow)
    rkey = context.partition_key
    res = rounds.evaluate(svc, rkey)
    hist = svc.registry.round_summaries()
    png = reward_curve_png([h["round"] for h in hist if "heldout_reward" in h],
                           [h["heldout_reward"] for h in hist if "heldout_reward" in h],
                           [h.get("heldout_reward_ci", 0.0) for h in hist if "heldout_reward" in h],
                           [bool(h.get("deployed")) for h in hist if "heldout_reward" in h])
    run_id = svc.lineage.round_run(rkey)
    cand = res["candidate"]
    if cand is not None:
        svc.lineage.log_metrics(run_id, {"heldout_reward": cand["mean"], "heldout_reward_ci95": cand["ci95"],
                                         "live_heldout_reward": res["live"]["mean"]}, 0)
    svc.lineage.log_bytes(run_id, png, "reward_curve.png", "plots")
    return MaterializeResult(metadata={
        "candidate_reward": cand["mean"] if cand else float("nan"),
        "candidate_ci95": cand["ci95"] if cand else float("nan"),
        "live_reward": res["live"]["mean"], "live_version": res["live_version"],
        "num_tasks": len(res["live"]["rewards"]), "smoke_error": res["smoke_error"] or "none",
        "suite": svc.suite.name, "reward_errors": cand.get("reward_errors", 0) if cand else 0,
        "first_reward_error": (cand.get("first_reward_error") or "none") if cand else "none",
        "reward_curve": MetadataValue.md(markdown_image(png, "held-out reward")),
    })


@round_asset(deps=[heldout_eval])
def deployment(context: AssetExecutionContext, settings: ProdRLSettings, store: StoreResource,
               mlflow: MlflowResource) -> MaterializeResult:
    """Redeploy through the deploy target: the new export serves, passes its health check and parity
    probe, then becomes the live policy and the registry `champion`. A failed probe rolls back (the
    previous version keeps serving, `champion` stays), tags the model version with the reason and
    fails this asset. Only materialised when the blocking `deployment_gate` check passed."""
    from prodrl_pipelines.deploy_targets.rollout import DeployRejected

    svc = services(settings, store, mlflow)
    rkey = context.partition_key
    version = svc.registry.round_summary(rkey).get("model_version")
    run_id = svc.lineage.round_run(rkey)
    try:
        dep, rollout = rounds.deploy(svc, rkey, model_version=version)
    except DeployRejected as e:
        if e.probe is not None:
            svc.lineage.log_metrics(run_id, _numeric(e.probe.metrics()), 0)
        tags = {"deployed": "false", "deploy_failed": e.reason[:4000], "rolled_back": e.rollback[:4000]}
        if version:
            svc.lineage.tag_version(version, tags)
        svc.lineage.set_tags(run_id, tags)
        raise Failure(description=f"{rkey} was not deployed: {e}",
                      metadata={"reason": e.reason, "rolled_back": e.rollback,
                                **(_numeric(e.probe.metrics()) if e.probe is not None else {})}) from e
    meta = rollout.metadata()
    svc.lineage.log_metrics(run_id, _numeric(meta), 0)
    if version:
        svc.lineage.promote(version)
        svc.lineage.tag_version(version, {"deployed": "true", "deploy_target": meta["target"]})
    svc.lineage.set_tags(run_id, {"deployed": "true"})
    svc.lineage.finish(run_id)
    return MaterializeResult(metadata={"policy_version": dep.policy_version, "export_dir": dep.export_dir,
                                       "model_version": version or "", "deployed_at": dep.deployed_at,
                                       "endpoint": MetadataValue.url(meta["endpoint"]) if meta["endpoint"] else "none",
                                       **{k: v for k, v in meta.items() if k != "endpoint"}})


def _numeric(d: dict) -> dict:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and v == v and abs(v) != float("inf")}
