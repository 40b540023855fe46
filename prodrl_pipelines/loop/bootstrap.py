"""Round 0: the base policy from the model source, exported, evaluated, made live and registered."""

from __future__ import annotations

from pathlib import Path

from prodrl_pipelines.loop.round_state import BASE_VERSION
from prodrl_pipelines.loop.round_state import DEPLOYED, utc_now
from prodrl_pipelines.loop.review import state_tags
from prodrl_pipelines.loop.promotion import make_live
from prodrl_pipelines.loop.export import calibration_prompts
from prodrl_pipelines.loop.evaluate import evaluate_export
from prodrl_pipelines.loop.services import Services, publish_checkpoint, publish_export


def bootstrap_base_policy(svc: Services, progress: bool = True) -> dict:
    """Round 0: import the base model (``base_model``: the user's HF directory or s3:// URI, or a
    registered source such as the lab's), export it, evaluate it on the suite and make it live.

    The trainer state starts fresh: the first round finds no optimizer state beside the checkpoint
    and creates Adam's, and the baseline starts empty. Re-running it after a crash reuses an already
    imported checkpoint."""
    from prodrl_pipelines.loop.model_source import import_base_model
    from prodrl_pipelines.loop.phases import PhaseMeter
    from prodrl_pipelines.quant.export import export_policy

    s = svc.settings
    suite = svc.suite  # a bad suite fails before the (possibly long) import
    ckpt = s.checkpoints_root / BASE_VERSION
    facts = {}
    meter = PhaseMeter()  # where the time and memory go
    with meter.phase("import"):
        if not (ckpt / "config.json").exists():
            facts = import_base_model(s.base_model, ckpt, s, svc.s3_endpoint_url)
        publish_checkpoint(svc, BASE_VERSION, ckpt)
    scheme = s.deploy.export_scheme
    with meter.phase("export"):
        exp = export_policy(ckpt, s.exports_root / BASE_VERSION, scheme,
                            calibration_prompts=calibration_prompts(svc, None) if scheme == "nvfp4-w4a4" else None)
        # published before it is deployed: a fleet's nodes without this host's disk fetch it from the store
        exp["source"] = publish_export(svc, BASE_VERSION, Path(exp["export_dir"]))
    with meter.phase("evaluate"):
        ev = evaluate_export(svc, s.exports_root / BASE_VERSION, BASE_VERSION)
        svc.ledger.record_eval(BASE_VERSION, ev)
    with meter.phase("deploy"):  # served through the deploy target, probed
        _, rollout = make_live(svc, BASE_VERSION, by="bootstrap")
    if svc.ledger.decision(BASE_VERSION) is None:  # round 0 is decided by construction
        svc.ledger.record_decision(BASE_VERSION, {"passed": True, "deployed": True, "review": "none", "base": True,
                                                    "decided_by": "bootstrap", "decided_at": utc_now(),
                                                    "candidate_mean": ev["mean"], "n_tasks": len(ev["rewards"])})
    svc.ledger.update_round(BASE_VERSION, heldout_reward=ev["mean"], heldout_reward_ci=ev["ci95"],
                              gate_passed=True, deployed=True, policy_version=BASE_VERSION, num_trajectories=0,
                              base_model=s.base_model, suite=suite.name, phases=meter.phases, **rollout.metadata())
    return {"checkpoint_dir": str(ckpt), "export": exp, "heldout_reward": ev["mean"], "heldout_ci95": ev["ci95"],
            "phases": meter.phases,
            "deployment": rollout.metadata(),
            "reward_errors": ev["reward_errors"], "base_model": s.base_model,
            **{k: v for k, v in facts.items() if k in ("source", "architectures", "parameters", "vocab_size")}}


def bootstrap(svc: Services) -> dict:
    """``bootstrap_base_policy`` plus its lineage: an MLflow run for round 0 and the base export
    registered as a model version with alias ``champion`` (what the `base_policy` asset and
    ``prodrl bootstrap`` both run)."""
    stats = bootstrap_base_policy(svc)
    if svc.lineage is None:
        return stats
    s = svc.settings
    run_id = svc.lineage.round_run(BASE_VERSION, params={"base_model": s.base_model, "eval_suite": s.eval.suite,
                                                         "export_scheme": s.deploy.export_scheme})
    version = svc.lineage.register_candidate(stats["export"]["source"], run_id, BASE_VERSION, {
        **state_tags(DEPLOYED, base=True), "format": s.deploy.export_scheme,
        "heldout_reward": f"{stats['heldout_reward']:.4f}", "base_model": s.base_model})
    svc.lineage.log_metrics(run_id, {"heldout_reward": stats["heldout_reward"],
                                     **{f"{n}_{k}": v for n, p in stats["phases"].items() for k, v in p.items()}}, 0)
    svc.lineage.promote(version)
    svc.lineage.describe_version(version, f"{BASE_VERSION}: the base model {s.base_model}, held-out reward "
                                          f"{stats['heldout_reward']:.4f}; deployed by bootstrap.")
    svc.lineage.finish(run_id)
    live = svc.ledger.live()
    live.model_version = version
    svc.ledger.deploy(live)
    svc.ledger.update_round(BASE_VERSION, model_version=version, mlflow_run_id=run_id)
    return {**stats, "model_version": version, "mlflow_run_id": run_id}
