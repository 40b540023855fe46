"""LoRA adapters in ``prodrl serve`` (``--enable-lora``), with vLLM's names for them.

``--lora-modules NAME=PATH`` at start-up and, at run time, ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``); a request
whose ``model`` is an adapter's name is served by base + that adapter, and ``/v1/models`` lists
each adapter with the base as its ``parent``, as vLLM does.

vLLM applies adapters in its kernels beside one copy of the base; here each adapter is served by a
copy of the base with the adapter folded in (W + (alpha / r) B A): the lab's models are small, and
the merged copy computes exactly what the trainer's reference (``rl.lora.served_policy``) does. The
memory is one base per adapter loaded, which is why the adapter targets unload old ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from prodrl_pipelines.engines.openai_protocol import ProtocolError
from prodrl_pipelines.engines.serve_http import error_response, json_body


@dataclass
class Adapter:
    name: str
    path: str
    engine: object
    created: int


def adapter_engine(base, path: str | Path):
    """An engine serving ``base`` (a ``LocalEngine``) with the PEFT adapter at ``path`` folded in."""
    import copy

    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.rl.lora import folded

    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise ValueError(f"{path} is not a PEFT adapter (no adapter_config.json)")
    return LocalEngine(folded(copy.deepcopy(base.model), path), base.tokenizer)


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """``NAME=PATH`` items of ``--lora-modules``."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        out.append((name, path))
    return out


def load(state, name: str, path: str) -> Adapter:
    """On the engine thread (between batches): the adapter ``name`` made servable."""
    if name in state.batcher.adapters or name == state.info.name:
        raise ProtocolError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    adapter = Adapter(name, str(path), adapter_engine(state.engine, path), int(time.time()))
    state.batcher.adapters[name] = adapter
    return adapter


async def load_lora_adapter(request: Request) -> Response:
    state = request.app.state.serve
    try:
        body = await json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ProtocolError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        await state.batcher.call(load, state, name, path)
    except ProtocolError as exc:
        return error_response(exc)
    except (OSError, ValueError) as exc:
        return error_response(ProtocolError(f"cannot load the adapter {name!r} from {path}: {exc}", param="lora_path"))
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


async def unload_lora_adapter(request: Request) -> Response:
    state = request.app.state.serve
    try:
        body = await json_body(request)
    except ProtocolError as exc:
        return error_response(exc)
    name = body.get("lora_name")

    def drop():  # on the engine thread: a batch of this adapter's calls already running finishes first
        return state.batcher.adapters.pop(name, None)

    if await state.batcher.call(drop) is None:
        return error_response(ProtocolError(f"The lora adapter '{name}' cannot be found.", status=404,
                                            param="lora_name"))
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


def model_cards(state) -> list[dict]:
    """``/v1/models``: the base, then each adapter with the base as its parent."""
    info = state.info
    base = {"id": info.name, "object": "model", "created": info.created, "owned_by": "prodrl",
            "root": info.model_dir, "parent": None, "max_model_len": info.max_model_len, "permission": []}
    return [base] + [{**base, "id": a.name, "created": a.created, "root": a.path, "parent": info.name}
                     for a in state.batcher.adapters.values()]


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": model_cards(request.app.state.serve)})
