"""The HTTP plumbing ``prodrl serve``'s endpoints share: JSON bodies, request validation, vLLM's error
answers, the model-name check and tokenization."""

from __future__ import annotations

import json

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from prodrl_pipelines.engines.openai_protocol import ProtocolError, error_body, read_body
from prodrl_pipelines.engines.serve_state import ServeState

__all__ = ["error_response", "json_body", "validate", "check_model", "tokenize", "whole_stream"]


def error_response(exc: ProtocolError | str, status: int | None = None) -> JSONResponse:
    if isinstance(exc, ProtocolError):
        return JSONResponse(error_body(str(exc), exc.status, exc.param), status_code=exc.status)
    status = status or 400
    return JSONResponse(error_body(str(exc), status), status_code=status)


async def json_body(request: Request) -> dict:
    raw = await read_body(request, request.app.state.serve.max_body_bytes)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    return body


def validate(model_cls, body: dict):
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise ProtocolError(f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")),
                            param=loc or None) from None


def check_model(state: ServeState, model: str | None) -> None:
    if model is not None and model != state.info.name and model not in state.batcher.adapters:
        raise ProtocolError(f"The model `{model}` does not exist.", status=404, param="model")


def tokenize(state: ServeState, text: str, add_special_tokens: bool) -> list[int]:
    tok = state.engine.tokenizer
    return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])


async def whole_stream(events):
    """A stream's events (bytes) sent as one piece: generation is over before the first event (the
    stream is simulated), so the client gets the same bytes in one write instead of one per token,
    each of which costs both ends a send and a read."""
    yield b"".join(events)
