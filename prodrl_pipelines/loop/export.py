"""Step 4 of a round: the deployable export of the trained checkpoint, smoke-tested as deployed."""

from __future__ import annotations

from pathlib import Path

from prodrl_pipelines.config.settings import Settings
from prodrl_pipelines.loop.gate import GateDecision
from prodrl_pipelines.loop.round_state import BASE_VERSION
from prodrl_pipelines.loop.services import RoundError, Services, ensure_local, refuse_if_decided, upstream_table
from prodrl_pipelines.storage import keys

SMOKE_PROMPTS = 4


def calibration_prompts(svc: Services, rkey: str | None, n: int = 64) -> list[list[int]]:
    """Recorded prompts of the round (its selected traffic), else the suite's prompts (round 0)."""
    key = keys.dataset(rkey) if rkey else None
    if key and svc.blobs.exists(key):
        seen, out = set(), []
        for p in upstream_table(svc, key)["prompt_token_ids"].to_pylist():
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
    from prodrl_pipelines.evaluation.suite import first_messages
    from prodrl_pipelines.evaluation.smoke import smoke_generate

    try:
        tok = AutoTokenizer.from_pretrained(export_dir)
        tools = getattr(suite, "tools", None)
        prompts = [render_prompt(tok, m, tools)[1] for m in first_messages(suite, SMOKE_PROMPTS, settings.recipe.seed)]
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

    from prodrl_pipelines.loop.phases import PhaseMeter
    from prodrl_pipelines.quant.export import ExportError, NonFiniteWeightsError, export_policy

    refuse_if_decided(svc, rkey, "exported_policy")
    s = svc.settings
    src = ensure_local(svc, "checkpoints", rkey)
    if not (src / "config.json").exists():
        raise RoundError(f"trained checkpoint of {rkey} is missing at {src}: materialise trained_checkpoint")
    scheme = s.deploy.export_scheme
    calib = calibration_prompts(svc, rkey) if scheme == "nvfp4-w4a4" else None
    meter = PhaseMeter()
    try:
        with meter.phase("export"):
            stats = export_policy(src, s.exports_root / rkey, scheme, calibration_prompts=calib)
    except NonFiniteWeightsError as e:
        d = GateDecision(passed=False, reasons=[f"export refused: {e}"])
        svc.ledger.record_decision(rkey, {**_asdict(d), "deployed": False, "stage": "export"})
        svc.ledger.update_round(rkey, gate_passed=False, gate_reasons=d.reasons, deployed=False)
        raise RoundError(f"{rkey}: {e}") from e
    except ExportError as e:  # permanent for this checkpoint: no retries
        raise RoundError(f"{rkey}: {e}") from e
    stats.update(_adapter_part(svc, src, Path(stats["export_dir"])))
    with meter.phase("smoke"):
        stats["smoke"] = export_smoke(s, Path(stats["export_dir"]), svc.suite)
    stats["phases"] = meter.metadata()
    lora = {k: stats[k] for k in ("adapter_bytes", "lora_base_version") if k in stats}
    svc.ledger.update_round(rkey, export_scheme=scheme, export_bytes=stats["export_bytes"],
                              export_max_rel_error=stats["max_rel_fro_error"], export_phases=meter.phases, **lora)
    return stats


def _adapter_part(svc: Services, checkpoint_dir: Path, export_dir: Path) -> dict:
    """A LoRA round's export also carries its adapter and names its base's export (what the adapter
    targets load into running servers); {} for a full round."""
    from prodrl_pipelines.deploy_targets import ADAPTER_TARGETS
    from prodrl_pipelines.quant.adapter_export import AdapterExportError, write_adapter_export
    from prodrl_pipelines.rl.lora import adapter_of

    adapter, base_version = adapter_of(checkpoint_dir)
    if adapter is None:
        return {}
    try:
        return write_adapter_export(checkpoint_dir, export_dir, base_version,
                                    ensure_local(svc, "exports", base_version),
                                    "adapter" if svc.settings.deploy.target in ADAPTER_TARGETS else "merged")
    except AdapterExportError as e:
        raise RoundError(f"{export_dir.name}: {e}") from e
