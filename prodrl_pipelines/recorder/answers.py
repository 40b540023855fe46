"""The answer the client gets back (minus what the recorder added), and streamed answers accumulated into a record."""

from __future__ import annotations

from typing import Any

from prodrl_pipelines.engines.logprob_parsing import narrow_entries, parse_token_id
from prodrl_pipelines.engines.openai_protocol import (
    EXTRA_IDS_FIELD,
    ROUTED_EXPERTS_FIELD,
    ProtocolError,
)
from prodrl_pipelines.recorder.counters import Stats
from prodrl_pipelines.recorder.requests import Ask
from prodrl_pipelines.recorder.upstream_view import TokenStrings


# ----------------------------------------------------------------------------- answer rewriting


class Rewriter:
    """Strips what the client did not ask for from answers (whole or streamed chunk by chunk)."""

    def __init__(self, kind: str, ask: Ask, tokens: TokenStrings | None, stats: Stats, n_up: int | None) -> None:
        self.kind, self.ask, self.tokens, self.stats = kind, ask, tokens, stats
        self.n_up = n_up  # the logprobs / top_logprobs the upstream was asked for
        self.convert = not ask.as_ids and tokens is not None
        self._warned = False

    def _tok(self, s: str) -> str:
        if not self.convert:
            return s
        try:
            return self.tokens.piece(parse_token_id(s))  # type: ignore[union-attr]
        except ProtocolError:
            return s

    def _completion_lp(self, lp: dict) -> dict:
        n = self.ask.n or 0
        tops = []
        for top in lp.get("top_logprobs") or []:
            if top is None:
                tops.append(None)
                continue
            entries = list(top.items())
            if self.n_up is not None and n < self.n_up:
                entries = narrow_entries(entries, self.n_up, n)
            out: dict[str, float] = {}
            for k, v in entries:
                out[self._tok(k)] = v
            tops.append(out)
        tokens = [self._tok(t) for t in lp.get("tokens") or []]
        offsets = list(lp.get("text_offset") or [])
        if offsets and self.convert:
            start = offsets[0]
            offsets = [start]
            for t in tokens[:-1]:
                offsets.append(offsets[-1] + len(t))
        return {**lp, "tokens": tokens, "top_logprobs": tops, "text_offset": offsets}

    def _chat_lp(self, lp: dict) -> dict:
        n = self.ask.n or 0
        content = []
        for item in lp.get("content") or []:
            tops = []
            entries = item.get("top_logprobs") or []
            if self.n_up is not None and n != -1 and n < self.n_up and entries:
                by_token = {e.get("token"): e for e in entries}  # token-id strings: unique
                kept = narrow_entries([(e.get("token"), float(e.get("logprob", 0.0))) for e in entries], None, n)
                entries = [by_token[t] for t, _ in kept[:n]]
            for i, e in enumerate(entries):
                if i < n or n == -1:
                    tok = self._tok(e.get("token", ""))
                    tops.append({**e, "token": tok, "bytes": list(tok.encode("utf-8", errors="replace"))
                                 if self.convert else e.get("bytes")})
            content.append({**item, "token": self._tok(item.get("token", "")), "top_logprobs": tops})
        return {**lp, "content": content}

    def rewrite(self, data: dict) -> dict:
        """``data`` rewritten in place (a whole answer or one stream chunk)."""
        if not isinstance(data, dict):
            return data
        ask = self.ask
        if self.kind == "chat":
            if not ask.token_ids and data.get("prompt_token_ids") is not None:
                data["prompt_token_ids"] = None
            if not ask.prompt_text and "prompt_text" in data:
                data["prompt_text"] = None
        for choice in data.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if not ask.token_ids:
                if choice.get("token_ids") is not None:
                    choice["token_ids"] = None
                if choice.get("prompt_token_ids") is not None:
                    choice["prompt_token_ids"] = None
            if not ask.extra and EXTRA_IDS_FIELD in choice:
                del choice[EXTRA_IDS_FIELD]  # absent, as from an upstream not asked for it
            # the deployment returns routing for the record (a server flag, megabytes on a large MoE):
            # a client never asked for it
            choice.pop(ROUTED_EXPERTS_FIELD, None)
            lp = choice.get("logprobs")
            if lp is not None:
                if ask.n is None:
                    choice["logprobs"] = None
                elif isinstance(lp, dict):
                    choice["logprobs"] = self._completion_lp(lp) if self.kind == "completion" else self._chat_lp(lp)
        if not ask.as_ids and self.tokens is None and not self._warned and ask.n is not None:
            self.stats.inc("token_strings_left_as_ids")
            self._warned = True
        return data


# ----------------------------------------------------------------------------- records


class StreamAccumulator:
    """Rebuilds the non-streamed answer shape of one streamed choice from its chunks."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.model: str | None = None
        self.prompt_ids: list[int] | None = None
        self.prompt_text: str | None = None
        self.ids: list[int] = []
        self.have_ids = False
        self.extra: list[int] = []
        self.have_extra = False
        self.text: list[str] = []
        self.comp_lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        self.chat_lp: list = []
        self.have_lp = False
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.reasoning: list[str] = []  # chat: the reply parser's reasoning deltas
        self.tool_calls: dict[int, dict] = {}  # chat: parsed tool calls by index (whole or in pieces)
        self.error: Any = None
        self.extra_choices = False
        self.routed_experts: str | None = None

    def add(self, chunk: dict) -> None:
        if not isinstance(chunk, dict):
            return
        if "error" in chunk and chunk.get("error"):
            self.error = chunk["error"]
            return
        self.model = chunk.get("model", self.model)
        if self.kind == "chat":
            if chunk.get("prompt_token_ids") is not None:
                self.prompt_ids = chunk["prompt_token_ids"]
            if chunk.get("prompt_text") is not None:
                self.prompt_text = chunk["prompt_text"]
        for ch in chunk.get("choices") or []:
            if ch.get("index", 0) != 0:
                self.extra_choices = True
                continue
            if self.kind == "completion":
                if ch.get("prompt_token_ids") is not None:
                    self.prompt_ids = ch["prompt_token_ids"]
                self.text.append(ch.get("text") or "")
            else:
                self._delta(ch.get("delta") or {})
            if ch.get("token_ids") is not None:
                self.have_ids = True
                self.ids.extend(ch["token_ids"])
            if ch.get(ROUTED_EXPERTS_FIELD) is not None:  # the whole request's, on its last chunk
                self.routed_experts = ch[ROUTED_EXPERTS_FIELD]
            extra = ch.get(EXTRA_IDS_FIELD)
            if extra is not None:
                self.have_extra = True
                if isinstance(extra, list):
                    self.extra.extend(extra)
                else:
                    self.extra.append(extra)  # malformed: build_row rejects it
            lp = ch.get("logprobs")
            if isinstance(lp, dict):
                self.have_lp = True
                if self.kind == "completion":
                    for key in ("tokens", "token_logprobs", "top_logprobs"):
                        self.comp_lp[key].extend(lp.get(key) or [])
                else:
                    self.chat_lp.extend(lp.get("content") or [])
            if ch.get("finish_reason") is not None:
                self.finish = ch["finish_reason"]
                self.stop_reason = ch.get("stop_reason")

    def _delta(self, delta: dict) -> None:
        self.text.append(delta.get("content") or "")
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str):
            self.reasoning.append(reasoning)
        for tc in delta.get("tool_calls") or []:
            if not isinstance(tc, dict):
                continue
            acc = self.tool_calls.setdefault(int(tc.get("index") or 0), {"id": None, "type": "function",
                                                                        "function": {"name": "", "arguments": ""}})
            acc["id"] = tc.get("id") or acc["id"]
            fn = tc.get("function") or {}
            acc["function"]["name"] += fn.get("name") or ""
            acc["function"]["arguments"] += fn.get("arguments") or ""

    def answer(self) -> dict:
        text = "".join(self.text)
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "prompt_token_ids": self.prompt_ids,
                      "token_ids": self.ids if self.have_ids else None,
                      "logprobs": self.comp_lp if self.have_lp else None, "finish_reason": self.finish}
        else:
            message = {"role": "assistant", "content": text}
            if self.reasoning:
                message["reasoning"] = "".join(self.reasoning)
            if self.tool_calls:
                message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            choice = {"index": 0, "message": message, "token_ids": self.ids if self.have_ids else None,
                      "logprobs": {"content": self.chat_lp} if self.have_lp else None, "finish_reason": self.finish,
                      "stop_reason": self.stop_reason}
        if self.have_extra:
            choice[EXTRA_IDS_FIELD] = self.extra
        if self.routed_experts is not None:
            choice[ROUTED_EXPERTS_FIELD] = self.routed_experts
        if self.kind == "completion":
            return {"model": self.model, "choices": [choice]}
        return {"model": self.model, "prompt_token_ids": self.prompt_ids, "prompt_text": self.prompt_text,
                "choices": [choice]}
