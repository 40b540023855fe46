"""The parity probe: does the new deployment sample from the distribution the trainer thinks it does?

After a deploy, a fixed set of recorded prompts goes through the new deployment (token-id prompts,
the deployment's sampling parameters, a fixed seed, logprobs on): for every sampled token ``a`` the
probe compares the served ``log mu_new(a|h)`` with the trainer's ``log pi(a|h)`` of the same
checkpoint in fp32, both as processed distributions (temperature, top-k, top-p: the same
``processed_logprobs`` the corrections use), the trainer loading the *export's* weights upcast to
fp32 (``rl.checkpoint.load_policy``: the same weights, so the bound measures the serving stack,
not the quantization; a W4A4 export's activation quantization is the deployment's own and counts). A wrong export, a wrong quantization scheme, weights
loaded into the wrong layers or a server that serves another model all move these far beyond the
quantization error. Passed when the mean and the 99th percentile of ``|delta|`` are within
``deploy.probe_bounds()`` (per export scheme unless set). Sampled tokens outside the trainer's top-k/top-p
support (``log pi = -inf``: near-ties that quantization reorders) are counted, not averaged.

Measured on the lab models with the local engine (fp32 on the export's weights): bf16 and W4A16
give 0.0000; W4A4 (activation quantization the trainer does not simulate) 0.006 mean on the tiny
model and 0.19-0.24 mean, p99 2.8, on the trained demo model. vLLM's bf16 kernels add ~0.005 mean
(max 0.15 on the tiny model). A
broken deployment is far off: vLLM's CPU in-place reload of other weights left 0.17 nats mean
(settings.PROBE_BOUNDS: 0.05 / 0.5 for bf16 and W4A16, 0.5 / 5 for W4A4).

``endpoint=None`` (the ``pointer`` target, where the lab serves the export itself) probes the export
as the local engine serves it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class ProbeResult:
    passed: bool
    reason: str
    mean_abs: float
    p99_abs: float
    max_abs: float
    tokens: int
    prompts: int
    out_of_support: int
    seconds: float
    engine: str

    def metrics(self) -> dict:
        return {f"probe_{k}": v for k, v in asdict(self).items() if k not in ("reason",)}


def compare(served: list[np.ndarray], trainer: list[np.ndarray], mean_bound: float, p99_bound: float) -> dict:
    d = np.concatenate([np.abs(np.asarray(s, dtype=np.float64) - t) for s, t in zip(served, trainer)]) \
        if served else np.zeros(0)
    bad = ~np.isfinite(d)
    finite = d[~bad]
    mean = float(finite.mean()) if finite.size else math.nan
    p99 = float(np.quantile(finite, 0.99, method="higher")) if finite.size else math.nan
    mx = float(finite.max()) if finite.size else math.nan
    reasons = []
    if not finite.size:
        reasons.append("the probe sampled no token the trainer can score")
    if finite.size and mean > mean_bound:
        reasons.append(f"mean |log mu_new - log pi_trainer| = {mean:.4f} > probe_mean_bound {mean_bound:g}")
    if finite.size and p99 > p99_bound:
        reasons.append(f"p99 |log mu_new - log pi_trainer| = {p99:.4f} > probe_p99_bound {p99_bound:g}")
    return {"passed": not reasons, "reason": "; ".join(reasons), "mean_abs": mean, "p99_abs": p99, "max_abs": mx,
            "tokens": int(d.size), "out_of_support": int(bad.sum())}


def parity_probe(settings, export_dir: Path, prompts: list[list[int]], endpoint: str | None,
                 served_model_name: str | None = None, api_key: str | None = None, seed: int = 0,
                 adapter: bool = False) -> ProbeResult:
    return parity_probes(settings, export_dir, prompts, [endpoint], served_model_name, api_key, seed, adapter)[0]


def parity_probes(settings, export_dir: Path, prompts: list[list[int]], endpoints: list[str | None],
                  served_model_name: str | None = None, api_key: str | None = None,
                  seed: int = 0, adapter: bool = False) -> list[ProbeResult]:
    """One probe per endpoint (every new server of a wave), the trainer loaded once for all of them.
    ``adapter``: the servers serve a LoRA export's adapter on its base export, so the trainer scores
    with base export + adapter (``rl.lora.served_policy``), what they serve."""
    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.evaluation.episodes import stop_token_ids
    from prodrl_pipelines.rl.checkpoint import load_policy

    t0 = time.monotonic()
    d = settings.deploy
    local = None if all(endpoints) else LocalEngine.from_pretrained(export_dir)
    if adapter:
        from prodrl_pipelines.quant.adapter_export import adapter_export
        from prodrl_pipelines.rl.lora import served_policy

        adapter_dir, _, base_export = adapter_export(export_dir)
        trainer = LocalEngine(*served_policy(base_export, adapter_dir, torch.float32))
    elif local is not None and not getattr(local.model, "_w4a4_hooks", None) \
            and next(local.model.parameters()).dtype == torch.float32:
        trainer = local  # the same fp32 weights, no activation quantization: one model in memory, not two
    else:
        trainer = LocalEngine(*load_policy(Path(export_dir), torch.float32))  # scores what was served
    params = d.sampling(stop_token_ids=stop_token_ids(trainer.tokenizer, export_dir))
    if settings.recipe.routing_replay != "recorded":  # routing is only recorded here to be replayed
        params = dataclasses.replace(params, record_routing=False)
    results = []
    for endpoint in endpoints:
        if endpoint:
            from prodrl_pipelines.engines.vllm_client import VLLMClient

            with VLLMClient(endpoint, api_key=api_key, model=served_model_name) as client:
                records = client.generate(prompts, params, seed=seed)
            engine = endpoint
        else:
            records = local.generate(prompts, params, seed=seed)
            engine = "local"
        # a trainer that replays the deployment's routing (R3) scores with the experts the deployment used
        replay = settings.recipe.routing_replay == "recorded" and any(r.routed_experts is not None for r in records)
        pi = trainer.score([r.prompt_token_ids for r in records], [r.output_token_ids for r in records], params,
                           routings=[r.routed_experts for r in records] if replay else None)
        served = [np.asarray(r.output_logprobs, dtype=np.float64) for r in records]
        cmp = compare(served, [np.asarray(x, dtype=np.float64) for x in pi], *d.probe_bounds())
        results.append(ProbeResult(prompts=len(prompts), seconds=time.monotonic() - t0, engine=engine, **cmp))
        t0 = time.monotonic()
    return results
