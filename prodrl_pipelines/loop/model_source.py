"""Where round 0 comes from: the user's Hugging Face causal LM (or a registered builder such as the lab's).

``base_model`` (settings) is one of:

- a local directory holding a Hugging Face causal LM: ``config.json``, safetensors weights, and a
  tokenizer with a chat template (any transformers architecture; Qwen3 dense and MoE are tested);
- ``s3://bucket/prefix``: the same directory in object storage (fetched with the store's endpoint);
- ``NAME`` or ``NAME:ARG``, NAME a registered model source (entry point group
  ``prodrl_pipelines.model_sources``, called as ``factory(ARG, settings)`` and returning an object
  with ``build(dest: Path) -> None``); the lab registers ``lab`` (its toy Qwen3, warm-started).

``import_base_model`` copies or builds the model into a staging directory, validates it there and
only then moves it into place, so a bad model never becomes ``round-000000``. Every check fails with
a message naming ``base_model`` and what is wrong: a missing directory, no ``config.json``, no
safetensors weights, no chat template, a tokenizer with more tokens than the model's embeddings,
non-finite weights, a model that does not load or generate.
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import entry_points
from pathlib import Path

MODEL_SOURCE_GROUP = "prodrl_pipelines.model_sources"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")


class ModelSourceError(ValueError):
    """The base model cannot be imported; the message says which setting and what is wrong."""


def registered_sources() -> dict:
    return {ep.name: ep for ep in entry_points(group=MODEL_SOURCE_GROUP)}


def describe(spec: str) -> str:
    """What kind of source ``spec`` names (for metadata and logs)."""
    if spec.startswith("s3://"):
        return "s3"
    if spec.partition(":")[0] in registered_sources():
        return spec.partition(":")[0]
    return "directory"


def source_is_moe(spec: str, settings=None) -> bool | None:
    """Whether the base model is a mixture of experts, known before it is imported: a directory's
    ``config.json``; a registered source that says (its optional ``mixture_of_experts()``); else None."""
    if spec.startswith("s3://"):
        return None
    name, _, arg = spec.partition(":")
    if name in registered_sources():
        says = getattr(registered_sources()[name].load()(arg, settings), "mixture_of_experts", None)
        return bool(says()) if callable(says) else None
    from prodrl_pipelines.deploy_targets.base import is_moe

    return is_moe(Path(spec)) if (Path(spec) / "config.json").is_file() else None


def _vocab_size(config: dict) -> int | None:
    if isinstance(config.get("vocab_size"), int):
        return config["vocab_size"]
    text = config.get("text_config") or {}
    return text.get("vocab_size") if isinstance(text.get("vocab_size"), int) else None


def validate_model_dir(path: Path, spec: str, generate: bool = True) -> dict:
    """Check that ``path`` is a usable causal LM for prodrl; returns facts about it."""
    where = f"base_model={spec!r}"
    if not path.is_dir():
        raise ModelSourceError(f"{where}: no such directory ({path})")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelSourceError(f"{where}: {path} has no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelSourceError(f"{where}: config.json is not JSON ({e})") from None
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelSourceError(f"{where}: no *.safetensors weights in {path} (other formats are not supported)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a bad model directory
        raise ModelSourceError(f"{where}: the tokenizer does not load ({type(e).__name__}: {e})") from None
    if not getattr(tok, "chat_template", None):
        raise ModelSourceError(f"{where}: the tokenizer has no chat template (prodrl renders every call through it; "
                               "add chat_template to tokenizer_config.json or chat_template.jinja)")
    vocab = _vocab_size(config)
    if vocab is None:
        raise ModelSourceError(f"{where}: config.json has no vocab_size")
    if len(tok) > vocab:
        raise ModelSourceError(f"{where}: the tokenizer has {len(tok)} tokens but the model's embeddings hold "
                               f"{vocab} (vocab_size): token ids past {vocab - 1} would index outside the embeddings")
    from safetensors import safe_open
    import torch

    n_params = 0
    for f in weights:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                n_params += t.numel()
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    raise ModelSourceError(f"{where}: tensor {name!r} in {f.name} has {bad} non-finite values")
    facts = {"architectures": config.get("architectures"), "model_type": config.get("model_type"),
             "vocab_size": vocab, "tokenizer_size": len(tok), "parameters": n_params}
    if generate:
        facts["smoke_text"] = _smoke(path, tok, where)
    return facts


def _smoke(path: Path, tok, where: str) -> str:
    """Load the model as the trainer and engine do and sample a few tokens from a chat prompt."""
    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.engines.types import SamplingParams
    from prodrl_pipelines.evaluation.episodes import render_prompt, stop_token_ids

    try:
        engine = LocalEngine.from_pretrained(path)
        _, ids = render_prompt(tok, [{"role": "user", "content": "Hello"}])
        rec = engine.generate([ids], SamplingParams(max_tokens=4, stop_token_ids=stop_token_ids(tok, path)), seed=0)[0]
    except Exception as e:  # noqa: BLE001 - a model that cannot generate is a bad base model
        raise ModelSourceError(f"{where}: the model does not load and generate ({type(e).__name__}: {e})") from None
    if not rec.output_token_ids:
        raise ModelSourceError(f"{where}: the model generated nothing")
    return tok.decode(rec.output_token_ids)


def _fetch_s3(spec: str, dest: Path, s3_endpoint_url: str | None) -> None:
    from prodrl_pipelines.storage.s3 import S3BlobStore

    bucket, _, prefix = spec[len("s3://"):].partition("/")
    if not bucket:
        raise ModelSourceError(f"base_model={spec!r}: expected s3://bucket/prefix")
    store = S3BlobStore(bucket, prefix.rstrip("/"), endpoint_url=s3_endpoint_url or None)
    keys = [k for k in store.list("") if "/" not in k.strip("/")]  # the model directory's own files
    if not keys:
        raise ModelSourceError(f"base_model={spec!r}: no objects under that prefix")
    dest.mkdir(parents=True)
    for k in keys:
        (dest / k).write_bytes(store.get_bytes(k))


def import_base_model(spec: str, dest: Path, settings=None, s3_endpoint_url: str | None = None,
                      generate: bool = True) -> dict:
    """Copy, fetch or build the base model named by ``spec`` into ``dest`` (atomically), validated."""
    spec = (spec or "").strip()
    if not spec:
        raise ModelSourceError("base_model is empty: name a model directory, an s3:// URI or a model source")
    dest = Path(dest)
    staging = dest.parent / f".{dest.name}.import"
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    kind = describe(spec)
    facts: dict = {}
    try:
        if kind == "s3":
            _fetch_s3(spec, staging, s3_endpoint_url)
        elif kind == "directory":
            src = Path(spec).expanduser()
            if not src.is_dir():
                raise ModelSourceError(f"base_model={spec!r}: no such directory ({src.resolve()})")
            facts = validate_model_dir(src, spec, generate=False)  # fail before copying gigabytes
            staging.mkdir()
            for f in src.iterdir():
                if f.is_file() and (f.suffix in (".safetensors", ".json", ".jinja", ".txt", ".model")
                                    or f.name in _TOKENIZER_FILES):
                    shutil.copy2(f, staging / f.name)
        else:
            name, _, arg = spec.partition(":")
            registered_sources()[name].load()(arg, settings).build(staging)
        if not facts:  # fetched or built: check what arrived (a copied directory was checked at its source)
            facts = validate_model_dir(staging, spec, generate=False)
        if generate:
            from transformers import AutoTokenizer

            facts["smoke_text"] = _smoke(staging, AutoTokenizer.from_pretrained(str(staging)), f"base_model={spec!r}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return {"source": kind, "base_model": spec, **facts}
