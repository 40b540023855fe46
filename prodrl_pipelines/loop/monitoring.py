"""Live monitoring: the held-out reward of what the deployment serves now, as a time series.

Each point evaluates the serving endpoint (``eval.live_endpoint``, else the deploy target's endpoint
file, else the local engine on the live export) with a fresh sampling seed (the evaluation index),
so successive points are independent samples; the alert compares the point with the deployed
round's own held-out evaluation.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prodrl_pipelines.loop.services import RoundError, Services


def live_endpoint(svc: Services) -> str:
    """Where the live policy is served: the configured endpoint, else the deploy target's."""
    from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file

    if svc.settings.eval.live_endpoint:
        return svc.settings.eval.live_endpoint
    ep = endpoint_file(svc.settings.home_path, svc.settings.deploy).read()
    live = svc.ledger.live()
    return ep.url if ep is not None and live is not None and ep.policy_version == live.policy_version else ""


def evaluate_endpoint(svc: Services, endpoint: str, export_dir: Path, policy_version: str) -> dict:
    """The suite through a serving endpoint (the tokenizer from the export renders the prompts)."""
    from transformers import AutoTokenizer

    from prodrl_pipelines.config import environment
    from prodrl_pipelines.engines.vllm_client import VLLMClient
    from prodrl_pipelines.evaluation import evaluate_policy

    with VLLMClient(endpoint, api_key=environment.eval_api_key(),
                    tokenizer=AutoTokenizer.from_pretrained(export_dir)) as client:
        if client.model != policy_version:
            raise RoundError(f"live endpoint {endpoint} serves {client.model!r}, but the live version is "
                             f"{policy_version!r}: the deployment is not serving the live policy")
        return evaluate_policy(svc.settings, svc.suite, export_dir, policy_version, engine=client)


def evaluate_live(svc: Services, index: int) -> dict:
    """Point ``index`` of the drift series: the live deployment's held-out reward now, sampled with
    seed ``eval_seed + 1 + index`` (the gate's own evaluation used ``eval_seed``)."""
    from prodrl_pipelines.evaluation import evaluate_policy

    live = svc.live()
    s = svc.settings
    fresh = replace(svc, settings=s.model_copy(update={"eval": s.eval.model_copy(
        update={"eval_seed": s.eval.eval_seed + 1 + index})}))
    endpoint = live_endpoint(svc)
    if endpoint:
        ev = evaluate_endpoint(fresh, endpoint, Path(live.export_dir), live.policy_version)
    else:
        ev = evaluate_policy(fresh.settings, svc.suite, Path(live.export_dir), live.policy_version)
    own = svc.ledger.eval(live.policy_version)
    return {"policy_version": live.policy_version, "model_version": live.model_version or "",
            "engine": endpoint or "local", "index": index, "seed": fresh.settings.eval.eval_seed,
            "heldout_reward": ev["mean"], "heldout_ci95": ev["ci95"], "num_tasks": len(ev["rewards"]),
            "reward_errors": ev["reward_errors"],
            "deployed_reward": own["mean"] if own else float("nan"), "tolerance": s.eval.gate_tolerance}


def alert(point: dict) -> tuple[bool, str]:
    """(ok, why): the live reward may not fall below the deployed round's own evaluation by more
    than the gate's tolerance."""
    floor = point["deployed_reward"] - point["tolerance"]
    drop = point["deployed_reward"] - point["heldout_reward"]
    text = (f"live held-out reward {point['heldout_reward']:.4f} vs {point['deployed_reward']:.4f} at deployment "
            f"({point['policy_version']}): drop {drop:+.4f}, tolerance {point['tolerance']:.4f}")
    ok = not (point["heldout_reward"] < floor)  # NaN (no recorded evaluation) never alerts
    return ok, ("ok: " if ok else "ALERT: ") + text
