"""The export smoke test: load it as the deployment does and generate a few prompts."""

from __future__ import annotations

import math
from os import PathLike


def smoke_generate(export_dir: str | PathLike, prompts: list[list[int]], params, seed: int = 0) -> list[dict]:
    """Load the export as the deployment does (LocalEngine) and generate on ``prompts``."""
    from prodrl_pipelines.engines.local import LocalEngine

    engine = LocalEngine.from_pretrained(export_dir)
    recs = engine.generate(prompts, params, seed=seed)
    out = []
    for p, r in zip(prompts, recs):
        lp = r.output_logprobs
        out.append({"prompt": engine.tokenizer.decode(p, skip_special_tokens=False) if engine.tokenizer else "",
                    "output": r.output_text, "mean_logprob": sum(lp) / len(lp) if lp else float("nan"),
                    "finite": all(math.isfinite(x) for x in lp)})
    return out
