"""What the APIs the recorder translates to chat (``responses``: OpenAI's Responses API, ``messages``:
Anthropic's Messages API) share: text given as a string or as a list of typed text pieces, and the
token counts an answer reports."""

from __future__ import annotations

from typing import Any, Callable

from prodrl_pipelines.engines.openai_protocol import ProtocolError


def joined_text(content: Any, where: str, bad: Callable[[str, str], ProtocolError], kinds: tuple[str, ...],
                noun: str) -> str:
    """``content`` as text: a string, or a list of ``{"type": <one of kinds>, "text": ...}`` pieces
    (parts, blocks) joined; anything else is ``bad(field, why)`` naming where it is."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"must be a string or a list of text {noun}s")
    out = []
    for i, piece in enumerate(content):
        if not isinstance(piece, dict) or piece.get("type") not in kinds:
            kind = piece.get("type") if isinstance(piece, dict) else type(piece).__name__
            raise bad(f"{where}[{i}]", f"is a {kind!r} {noun}: the recorder takes text {noun}s only here")
        if not isinstance(piece.get("text"), str):
            raise bad(f"{where}[{i}].text", "must be a string")
        out.append(piece["text"])
    return "".join(out)


def token_counts(prompt_ids: list | None, output_ids: list | None, upstream: dict | None) -> tuple[int, int] | None:
    """(prompt, output) tokens of an answer: the recorded ids when there are, else the upstream's usage."""
    if prompt_ids is not None and output_ids is not None:
        return len(prompt_ids), len(output_ids)
    if isinstance(upstream, dict) and "prompt_tokens" in upstream:
        return int(upstream.get("prompt_tokens") or 0), int(upstream.get("completion_tokens") or 0)
    return None
