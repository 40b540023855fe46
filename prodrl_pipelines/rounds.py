"""The steps of one prod-RL round, free of Dagster: each asset calls exactly one of these.

select -> batch -> train -> export -> evaluate -> gate here, then deploy (``promotion``: auto, or a
reviewer's approval or rollback from the registry). Every step reads its inputs
from the stores by round key (``keys``) and writes its outputs back, so any step can be re-run alone
and a crashed round can be resumed from the last finished step. Round 0 is ``bootstrap``; what the
steps work with is ``services``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from prodrl_pipelines import keys
from prodrl_pipelines.deployment import BASE_VERSION, round_index
from prodrl_pipelines.gate import GateDecision, decide
from prodrl_pipelines.services import (  # noqa: F401 - re-exported: callers use rounds.Services etc.
    RoundError, Services, _get_json, _get_table, _put_table, _vocab_size, ensure_local, preflight,
    publish_checkpoint, publish_export, round_seed, version_dirs,
)
from prodrl_pipelines.settings import Settings


def refuse_if_decided(svc: Services, rkey: str, step: str) -> None:
    """A decided round's data, checkpoint and export are its history: re-running the step that made
    them is refused, naming the decision (an explicit re-evaluation goes beside: ``evaluate_version``)."""
    from prodrl_pipelines.review import describe_decision, is_decided

    d = svc.registry.decision(rkey)
    if is_decided(d):
        raise RoundError(f"{rkey} is decided ({describe_decision(d)}): re-running {step} would rewrite its history. "
                         f"Its recorded results stay; to re-evaluate its export run `prodrl eval --policy {rkey}` "
                         "(stored beside the original)")


# --- 1. recorded_trajectories -------------------------------------------------------------
def select_data(svc: Services, rkey: str) -> dict:
    from prodrl_pipelines.trajectories.selection import InsufficientDataError, select_round_dataset

    refuse_if_decided(svc, rkey, "recorded_trajectories")
    s, live = svc.settings, svc.live()
    preflight(svc, live)
    try:
        sel = select_round_dataset(
            svc.store, rkey, live_version=live.policy_version, version_order=svc.registry.version_order(),
            max_policy_lag=s.recipe.max_policy_lag, n_required=s.recipe.trajectories_per_round,
            vocab_size=_vocab_size(live.checkpoint_dir), seed=round_seed(s, rkey),
        )
    except InsufficientDataError as e:
        raise RoundError(
            f"settings steps_per_round={s.recipe.steps_per_round} x batch_size={s.recipe.batch_size} = "
            f"{s.recipe.trajectories_per_round} trajectories per round exceed the available data: {e}"
        ) from e
    ds = sel.dataset
    # the retokenized baseline (DESIGN.md s.5) rebuilds the ids from the texts, as a naive pipeline would
    replay_stats: dict = {"replay": s.recipe.replay}
    if s.recipe.replay == "retokenized":
        from transformers import AutoTokenizer

        from prodrl_pipelines.engines.reply_parsers import get_reply_parser
        from prodrl_pipelines.evaluation.suite import reply_parser
        from prodrl_pipelines.trajectories.retokenize import retokenize_calls

        # the naive pipeline keeps the API's messages: the deployment's reply parser (the suite's)
        parser = reply_parser(svc.suite)
        ds, rstats = retokenize_calls(ds, AutoTokenizer.from_pretrained(live.checkpoint_dir),
                                      parse_reply=None if parser == "none" else get_reply_parser(parser))
        replay_stats.update(rstats.as_dict())
    _put_table(svc.blobs, keys.dataset(rkey), ds)
    rewards = np.asarray(ds.group_by("trajectory_id").aggregate([("reward", "max")])["reward_max"])
    versions = sorted(set(ds["policy_version"].to_pylist()))
    gen_tokens = int(sum(len(x) for x in ds["output_token_ids"].to_pylist()))
    stats = {
        "live_version": live.policy_version, "data_versions": versions,
        "num_trajectories": len(rewards), "num_calls": ds.num_rows, "generated_tokens": gen_tokens,
        "eligible": sel.n_eligible, "quarantined": sel.n_quarantined,
        "quarantine_reasons": dict(sel.quarantine_counts),
        "table_versions": dict(sel.table_versions),  # the store snapshot read: re-readable by time travel
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        **replay_stats,  # replay mode and, when retokenized, the retokenize counts
    }
    svc.registry.update_round(rkey, num_trajectories=len(rewards), data_reward_mean=stats["reward_mean"],
                              quarantined=sel.n_quarantined, table_versions=dict(sel.table_versions))
    return stats


def in_flight_pins(svc: Services) -> list[dict]:
    """The store snapshots (table versions) read by rounds not decided yet: a vacuum keeps their files."""
    from prodrl_pipelines.review import is_decided

    out = []
    for rkey in sorted({k.split("/")[1] for k in svc.blobs.list(keys.ROUNDS) if k.endswith("/summary.json")}):
        pin = svc.registry.round_summary(rkey).get("table_versions")
        if pin and not is_decided(svc.registry.decision(rkey)):
            out.append(pin)
    return out


# --- 2. training_batch ----------------------------------------------------------------------
def build_batch(svc: Services, rkey: str) -> dict:
    from prodrl_pipelines.rl.batch import trajectories_from_table
    from prodrl_pipelines.rl.checkpoint import load_trainer_state
    from prodrl_pipelines.rl.trainer import plan_minibatches, round_advantages

    refuse_if_decided(svc, rkey, "training_batch")
    s, live = svc.settings, svc.live()
    trajs = trajectories_from_table(_get_table(svc.blobs, keys.dataset(rkey)))
    state = load_trainer_state(Path(live.checkpoint_dir))
    adv = round_advantages(trajs, s.recipe, state)
    plan = plan_minibatches(trajs, s.recipe, round_seed(s, rkey))
    batch = {
        "trajectory_ids": [t.trajectory_id for t in trajs],
        "advantages": adv.tolist(),
        "plan": plan,
        "baseline_state": asdict(state.baseline),
        "recipe": s.recipe.model_dump(),
    }
    svc.store.put_json(keys.batch(rkey), batch)
    nz = float(np.mean(adv != 0))
    return {
        "steps": len(plan), "batch_size": s.recipe.batch_size, "baseline": s.recipe.baseline,
        "adv_mean": float(adv.mean()), "adv_std": float(adv.std()), "adv_nonzero_frac": nz,
        "generated_tokens_per_traj": float(np.mean([t.num_generated for t in trajs])),
    }


# --- 3. trained_checkpoint ------------------------------------------------------------------
def train(svc: Services, rkey: str, on_step: Callable[[int, dict], None] | None = None, progress: bool = True,
          rank: int = 0, world_size: int = 1, out_dir: Path | None = None) -> dict:
    """S Adam steps from the live checkpoint. With ``world_size > 1`` (``torchrun``) the policy is
    sharded with FSDP2, every rank trains its shard of each minibatch and only rank 0 writes the
    outputs."""
    import torch

    from prodrl_pipelines.rl.advantages import BaselineState
    from prodrl_pipelines.rl.batch import trajectories_from_table
    from prodrl_pipelines.rl.checkpoint import load_policy, load_trainer_state, save_checkpoint
    from prodrl_pipelines.rl.trainer import build_optimizer, train_round

    if out_dir is None:  # a worker's scratch copy is not the round's history
        refuse_if_decided(svc, rkey, "trained_checkpoint")
    s, live = svc.settings, svc.live()
    batch = _get_json(svc, keys.batch(rkey))
    trajs = {t.trajectory_id: t for t in trajectories_from_table(_get_table(svc.blobs, keys.dataset(rkey)))}
    trajs = [trajs[i] for i in batch["trajectory_ids"]]
    model, tokenizer = load_policy(Path(live.checkpoint_dir), dtype=torch.float32)
    state = load_trainer_state(Path(live.checkpoint_dir))
    state.baseline = BaselineState(**batch["baseline_state"])
    if s.recipe.activation_checkpointing:
        from prodrl_pipelines.rl.sharding import checkpoint_activations

        checkpoint_activations(model)
    trained, load_opt, sharded = model, None, world_size > 1
    if sharded:  # FSDP2: parameters, gradients and Adam state sharded over the ranks
        from prodrl_pipelines.rl import sharding

        trained = sharding.shard_policy(model, world_size)
        load_opt = lambda o, sd: sharding.load_full_optimizer_state(trained, o, sd)  # noqa: E731
    opt = build_optimizer(trained, s.recipe, state, load_opt)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # The policies that sampled this round's data: mu_k (sync), or mu_{k-1} and mu_k (one-round async).
    data_versions = sorted({t.policy_version for t in trajs})
    behavior_steps = {v: load_trainer_state(version_dirs(svc, v)[0]).global_step for v in data_versions}
    reference = None
    if s.recipe.needs_reference_model:
        preflight(svc, live)
        reference = {}
        for v in data_versions:  # each trajectory's own deployed weights, upcast
            export_dir = version_dirs(svc, v)[1]
            if not (export_dir / "prodrl_export.json").exists():
                raise RoundError(f"correction={s.recipe.correction!r} needs the deployed export of {v} (it sampled "
                                 f"data of {rkey}) as the reference model, but {export_dir} holds no export")
            reference[v], _ = load_policy(export_dir, dtype=torch.float32)
            reference[v].eval()
    # in-round resume: one file (one process), or one sharded directory every rank writes its part of
    resume = s.checkpoints_root / ".in-round" / (f"{rkey}-fsdp{world_size}" if sharded else f"{rkey}-rank{rank}.pt")
    res = train_round(trained, opt, trajs, np.asarray(batch["advantages"]), batch["plan"], s.recipe, state,
                      pad_id, round_seed(s, rkey), on_step=on_step, progress=progress, reference_model=reference,
                      resume_path=resume, rank=rank, world_size=world_size,
                      behavior_steps=behavior_steps)
    out = Path(out_dir) if out_dir is not None else s.checkpoints_root / rkey
    whole = {}
    if sharded:  # gathered by every rank (collectives), written whole by rank 0
        whole = {"model_state": sharding.full_model_state(trained),
                 "optimizer_state": sharding.full_optimizer_state(trained, opt)}
    if rank == 0:
        save_checkpoint(out, model, tokenizer, opt, state, **whole)
        if out_dir is None:  # the round's own checkpoint (not a worker's scratch copy)
            publish_checkpoint(svc, rkey, out)
        svc.store.put_json(keys.train_steps(rkey), res.steps)
        svc.registry.update_round(rkey, mismatch_abs_logp=res.mismatch_abs_logp, trained_from=live.policy_version,
                                  train_processes=world_size)
    if sharded:  # the round's checkpoint is complete
        sharding.remove_sharded_state(resume)
    else:
        resume.unlink(missing_ok=True)
    done = [m for m in res.steps if not m.get("skipped")]
    return {
        "checkpoint_dir": str(out), "trained_from": live.policy_version, "global_step": state.global_step,
        "resumed_from_step": res.resumed_from_step,
        "steps_taken": len(done), "steps_skipped": res.skipped_steps,
        "mismatch_abs_logp": res.mismatch_abs_logp,
        **res.layout.as_metrics(),
        "final_loss": done[-1]["loss"] if done else float("nan"),
        "mean_grad_norm": float(np.mean([m["grad_norm"] for m in done])) if done else float("nan"),
        "tokens_per_s": float(np.mean([m["tokens_per_s"] for m in done])) if done else float("nan"),
        "steps": res.steps,
    }


def training_history(svc: Services) -> tuple[list[dict], list[int]]:
    """Every trained step of every round so far, in order, and the index where each round starts."""
    steps, starts = [], []
    for key in sorted(k.split("/")[1] for k in svc.blobs.list(keys.ROUNDS) if k.endswith("/train_steps.json")):
        starts.append(len(steps))
        steps += [m for m in _get_json(svc, keys.train_steps(key)) if not m.get("skipped")]
    return steps, starts


# --- 4. exported_policy -----------------------------------------------------------------------
SMOKE_PROMPTS = 4


def _calibration_prompts(svc: Services, rkey: str | None, n: int = 64) -> list[list[int]]:
    """Recorded prompts of the round (its selected traffic), else the suite's prompts (round 0)."""
    key = keys.dataset(rkey) if rkey else None
    if key and svc.blobs.exists(key):
        seen, out = set(), []
        for p in _get_table(svc.blobs, key)["prompt_token_ids"].to_pylist():
            if tuple(p) not in seen:
                seen.add(tuple(p))
                out.append([int(t) for t in p])
            if len(out) == n:
                break
        return out
    from transformers import AutoTokenizer

    from prodrl_pipelines.evaluation.episodes import render_prompt
    from prodrl_pipelines.evaluation.suite import calibration_messages

    tok = AutoTokenizer.from_pretrained(svc.settings.checkpoints_root / BASE_VERSION)
    tools = getattr(svc.suite, "tools", None)
    return [render_prompt(tok, m, tools)[1] for m in calibration_messages(svc.suite, n, svc.settings.recipe.seed)]


def export_smoke(settings: Settings, export_dir: Path, suite) -> dict:
    """The export's own smoke generation: loaded as deployed (LocalEngine), a few held-out prompts."""
    from transformers import AutoTokenizer

    from prodrl_pipelines.evaluation.episodes import render_prompt, stop_token_ids
    from prodrl_pipelines.evaluation.smoke import smoke_generate

    try:
        tok = AutoTokenizer.from_pretrained(export_dir)
        tools = getattr(suite, "tools", None)
        prompts = [render_prompt(tok, suite.initial_messages(t), tools)[1] for t in suite.heldout_tasks(SMOKE_PROMPTS)]
        params = settings.deploy.sampling(stop_token_ids=stop_token_ids(tok, export_dir))
        return {"samples": smoke_generate(export_dir, prompts, params, seed=settings.eval.eval_seed), "error": ""}
    except Exception as e:  # noqa: BLE001 - reported; heldout_eval and the gate judge it
        return {"samples": [], "error": f"{type(e).__name__}: {e}"}


def export(svc: Services, rkey: str) -> dict:
    """The deployable export of the round's checkpoint (scheme: ``deploy.export_scheme``), smoke-tested.

    Non-finite weights are refused: the round is then decided (gate failed, not deployed, reasons
    naming the tensors) so the loop moves on from the live policy, and this step fails visibly.
    """
    from dataclasses import asdict as _asdict

    from prodrl_pipelines.phases import PhaseMeter
    from prodrl_pipelines.quant.export import ExportError, NonFiniteWeightsError, export_policy

    refuse_if_decided(svc, rkey, "exported_policy")
    s = svc.settings
    src = ensure_local(svc, "checkpoints", rkey)
    if not (src / "config.json").exists():
        raise RoundError(f"trained checkpoint of {rkey} is missing at {src}: materialise trained_checkpoint")
    scheme = s.deploy.export_scheme
    calib = _calibration_prompts(svc, rkey) if scheme == "nvfp4-w4a4" else None
    meter = PhaseMeter()
    try:
        with meter.phase("export"):
            stats = export_policy(src, s.exports_root / rkey, scheme, calibration_prompts=calib)
    except NonFiniteWeightsError as e:
        d = GateDecision(passed=False, reasons=[f"export refused: {e}"])
        svc.registry.record_decision(rkey, {**_asdict(d), "deployed": False, "stage": "export"})
        svc.registry.update_round(rkey, gate_passed=False, gate_reasons=d.reasons, deployed=False)
        raise RoundError(f"{rkey}: {e}") from e
    except ExportError as e:  # permanent for this checkpoint: no retries
        raise RoundError(f"{rkey}: {e}") from e
    with meter.phase("smoke"):
        stats["smoke"] = export_smoke(s, Path(stats["export_dir"]), svc.suite)
    stats["phases"] = meter.metadata()
    svc.registry.update_round(rkey, export_scheme=scheme, export_bytes=stats["export_bytes"],
                              export_max_rel_error=stats["max_rel_fro_error"], export_phases=meter.phases)
    return stats


# --- 5. heldout_eval ----------------------------------------------------------------------------
def evaluate_policy(svc: Services, export_dir: Path, policy_version: str) -> dict:
    """Held-out reward per task of one exported policy on the suite, served as the deployment would."""
    from prodrl_pipelines.evaluation import evaluate_policy as _evaluate

    return _evaluate(svc.settings, svc.suite, export_dir, policy_version)


def evaluate(svc: Services, rkey: str) -> dict:
    """The candidate and the live policy on the same held-out tasks. Once the gate has decided, the
    recorded evaluation is returned as it is (``reproduced``): a later live policy never re-judges it."""
    if svc.registry.decision(rkey) is not None:
        if svc.blobs.exists(keys.heldout(rkey)):
            return {**_get_json(svc, keys.heldout(rkey)), "reproduced": True}
        refuse_if_decided(svc, rkey, "heldout_eval")  # decided before any evaluation (e.g. at export)
    live = svc.live()
    export_dir = ensure_local(svc, "exports", rkey)
    cand, smoke_error = None, ""
    try:
        cand = evaluate_policy(svc, export_dir, rkey)
    except Exception as e:  # noqa: BLE001 - a candidate that cannot serve is a gate failure, not a crash
        smoke_error = f"{type(e).__name__}: {e}"
    live_eval = svc.registry.eval(live.policy_version)
    if live_eval is None or (cand is not None and live_eval["task_ids"] != cand["task_ids"]):
        live_eval = evaluate_policy(svc, Path(live.export_dir), live.policy_version)
        svc.registry.record_eval(live.policy_version, live_eval)
    if cand is not None:
        svc.registry.record_eval(rkey, cand)
    result = {"candidate": cand, "live": live_eval, "smoke_error": smoke_error, "live_version": live.policy_version}
    svc.store.put_json(keys.heldout(rkey), result)
    result["reproduced"] = False
    if cand is not None:
        svc.registry.update_round(rkey, heldout_reward=cand["mean"], heldout_reward_ci=cand["ci95"],
                                  live_heldout_reward=live_eval["mean"])
    return result


# --- 6. deployment_gate -----------------------------------------------------------------------
def heldout_verdict(svc: Services, ev: dict, nonfinite: dict | None = None) -> GateDecision:
    """The gate's paired test on a recorded evaluation (``nonfinite``: the export's bad tensors)."""
    s, cand, live = svc.settings, ev["candidate"], ev["live"]
    return decide(
        np.asarray(cand["rewards"]) if cand else np.asarray([]),
        np.asarray(live["rewards"]) if cand else np.asarray([]),
        tolerance=s.eval.gate_tolerance, z=s.eval.gate_z, nonfinite=nonfinite or {},
        smoke_ok=cand is not None and not ev["smoke_error"], smoke_error=ev["smoke_error"],
    )


def recorded_gate(decision: dict) -> GateDecision:
    from dataclasses import fields

    return GateDecision(**{f.name: decision[f.name] for f in fields(GateDecision) if f.name in decision})


def gate(svc: Services, rkey: str) -> tuple[GateDecision, bool]:
    """(decision, reproduced). The paired test against live on the recorded evaluation; a passing
    candidate then awaits deployment (``promotion: auto``) or review (``review``). A round with a
    decision returns it unchanged."""
    from prodrl_pipelines.quant.export import export_nonfinite

    recorded = svc.registry.decision(rkey)
    if recorded is not None:
        return recorded_gate(recorded), True
    s = svc.settings
    ev = _get_json(svc, keys.heldout(rkey))
    d = heldout_verdict(svc, ev, export_nonfinite(ensure_local(svc, "exports", rkey)))  # NVFP4 checked dequantized
    promotion = s.deploy.promotion
    review = "pending" if d.passed and promotion == "review" else "none"
    svc.registry.record_decision(rkey, {**asdict(d), "deployed": False, "promotion": promotion, "review": review})
    svc.registry.update_round(rkey, gate_passed=d.passed, gate_reasons=d.reasons, deployed=False, review=review)
    return d, False


def evaluate_version(svc: Services, policy_version: str | None = None) -> dict:
    """Held-out reward of ``policy_version`` (default: the live one) on the suite, from its export."""
    live = svc.registry.live()
    if policy_version is None:
        if live is None:
            raise RoundError("no live deployment: bootstrap first (`prodrl bootstrap`), or name --policy")
        policy_version = live.policy_version
    export_dir = ensure_local(svc, "exports", policy_version)
    if not (export_dir / "config.json").exists():
        raise RoundError(f"no export of {policy_version!r} at {export_dir}"
                         + ("" if svc.exports_store is None else f" nor in {svc.exports_store!r}"))
    ev = evaluate_policy(svc, export_dir, policy_version)
    if policy_version.startswith("round-"):  # beside the round's own evaluation, never over it
        from prodrl_pipelines.review import now

        stamp = now().replace(":", "").replace("+0000", "Z")
        key = keys.reevaluation(policy_version, stamp)
        svc.store.put_json(key, {**ev, "evaluated_at": stamp, "live_version": live.policy_version if live else None})
        ev = {**ev, "stored_at": key}
    return ev


# --- sensor ---------------------------------------------------------------------------------
def next_round_decision(svc: Services, existing_rounds: list[str], in_flight: bool) -> tuple[str | None, str]:
    """(round key to start, reason). Starts round k+1 only when round k is decided (a pending review
    waits) and S*B eligible data exists; each reason says what would unblock it."""
    from prodrl_pipelines.deployment import round_key
    from prodrl_pipelines.review import PENDING_REVIEW, round_state
    from prodrl_pipelines.trajectories.selection import count_eligible

    live = svc.registry.live()
    if live is None:
        return None, "no live deployment yet: materialise base_policy (the bootstrap job) or run `prodrl bootstrap`"
    if in_flight:
        return None, "a round is in flight; the next one starts when it has finished"
    rounds_only = [k for k in existing_rounds if k != BASE_VERSION]
    latest = max(rounds_only, key=round_index) if rounds_only else None
    state = round_state(svc.registry.decision(latest)) if latest else None
    if latest is not None and state == "running":
        return None, f"{latest} has not finished (no gate decision yet); re-execute its failed run to resume it"
    if state == PENDING_REVIEW:
        mv = svc.registry.round_summary(latest).get("model_version", "VERSION")
        return None, (f"{latest} awaits review: approve model version {mv} (move alias champion to it, tag "
                      f"review=approved, or `prodrl review approve {mv}`) or reject it (tag review=rejected, or "
                      f"`prodrl review reject {mv} --reason ...`)")
    need = svc.settings.recipe.trajectories_per_round
    n = count_eligible(svc.store, live.policy_version, svc.registry.version_order(),
                       svc.settings.recipe.max_policy_lag, _vocab_size(live.checkpoint_dir))
    if n < need:
        return None, (f"{n}/{need} eligible rewarded trajectories from {live.policy_version}: send {need - n} more "
                      "rewarded trajectories through the recorder")
    nxt = round_key((round_index(latest) if latest else 0) + 1)
    return nxt, f"{n} eligible trajectories >= S*B = {need}"
