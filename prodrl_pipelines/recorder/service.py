"""``prodrl record``: an OpenAI-compatible recording proxy in front of any vLLM-compatible server.

Clients talk to the recorder exactly as to vLLM (``POST /v1/completions``,
``POST /v1/chat/completions``, streaming or not, ``GET /v1/models``). For every call the recorder:

1. adds the recording fields to the upstream request: ``return_token_ids``,
   ``return_tokens_as_token_ids``, ``logprobs`` (completions: K; chat: ``logprobs: true`` and
   ``top_logprobs`` K + 1, at most ``--upstream-max-logprobs``, because vLLM's chat list starts with
   the sampled token and stops at n entries, so n = K + 1 gives an exact top-K head; with n = 20 the
   chat head has 19 entries), ``return_prompt_text`` (chat), and explicit ``temperature`` /
   ``top_p`` / ``top_k`` when the client left them out (the recorder's defaults: 1, 1, off) so what
   is recorded is what was sampled whatever the server's generation-config defaults;
2. answers the client with the upstream answer, minus what the client did not ask for (token ids,
   logprobs, more top logprobs than asked, token-id strings -- turned back into text with
   ``--tokenizer``, the served model's tokenizer; without it they stay ``token_id:<id>``);
3. records one ``CALL_SCHEMA`` row per call: the exact prompt and output ids, processed logprobs, the
   top-K head (``support_complete`` from the head, see ``head_support_complete``), the sampling
   params, prompt/output text, and the policy version (``X-Policy-Version`` header, else
   ``--policy-version``, else the upstream's model name). Rows are fsynced to the write-ahead log
   before the client gets its answer (for a stream: before the final ``data: [DONE]``, preceded by
   an SSE comment ``: prodrl trajectory_id=... call_index=...``).

Extra draw (``--record-extra-draw``): the recorder also asks the upstream for ``"extra_draw": true``
(a prodrl extension that ``prodrl serve`` implements, see ``openai_protocol``), stores the returned
per-choice ``extra_token_ids`` (one independent draw a' ~ mu per generated position, for the
``score_centering_sampled`` correction) in the ``extra_token_ids`` column, and strips them from the
answer unless the client asked for ``extra_draw`` itself (then they are also recorded, flag or not).
An upstream without the extension (vLLM) ignores the field: the call is still recorded, with
``extra_token_ids`` null, and counted (``extra_draw_missing``; ids of the wrong length or type:
``extra_draw_malformed``). Note that on ``prodrl serve`` the extra draw takes random numbers from the
request's stream, so a seeded request samples other tokens with the flag than without it.

Trajectories: calls carrying the same ``X-Trajectory-Id`` header form one trajectory, indexed 0, 1,
... in the order they complete; a call without the header starts a new one with a generated id. The
answer carries ``X-Trajectory-Id`` and (when not streaming) ``X-Call-Index`` and
``X-Prodrl-Recorded``. Optional ``X-Task-Id`` is stored as ``task_id``.

Rewards: ``POST /v1/feedback {"trajectory_id", "reward", "source"?}`` -> 200 once durable;
unknown trajectory 404; reward missing, not a number or not finite 422; malformed JSON 400.

Every route needs ``Authorization: Bearer <PRODRL_RECORDER_TOKEN>`` (401 otherwise; nothing is
recorded). ``GET /stats`` (JSON) and ``GET /metrics`` (Prometheus text) expose the counters.

Calls that cannot be recorded are still answered, counted (``unrecordable.<reason>``) and take
their call index (see ``ingest``), but are never stored: ``n > 1``, beam search, several prompts in
one request, echo, greedy (temperature < 1e-5: no stochastic policy to correct for), sampling
modifiers the trainer cannot reproduce (penalties, ``min_p``, ``logit_bias``, ``allowed_token_ids``,
``bad_words``, structured outputs...), and upstream answers without token ids or logprobs. Upstream
errors pass through unchanged (counted, not recorded); an upstream timeout is a 504, an unreachable
upstream a 502. One process (one uvicorn worker) per WAL directory.

Connections (what made 128-256 concurrent clients see resets): idle client connections stay open
``--timeout-keep-alive`` (120 s), longer than clients keep them for reuse (httpx 5 s, aiohttp 15 s;
uvicorn's own default of 5 s raced them); idle upstream connections are reused for at most
``--upstream-keepalive`` (3 s), below the upstream's keep-alive timeout (vLLM: 5 s); and a request
whose upstream connection is reset before any answer came back is sent once more
(``upstream_retries``): nothing is recorded before an answer, so this cannot record a call twice.

Store: ``--store DIR`` (Parquet parts under DIR, WAL in ``DIR/_recorder/wal``) or ``--s3-bucket``
(``--s3-prefix``, ``--s3-endpoint-url``, ``--s3-region``): parts go to ``s3://bucket/prefix/`` with the
local store's key layout while the WAL stays on local disk (``--wal-dir``, required then). Start-up
replay reads the stored parts through the same ``BlobStore`` interface on both.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import math
import os
import re
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prodrl_pipelines.engines.openai_protocol import (
    EXTRA_DRAW_FIELD,
    EXTRA_IDS_FIELD,
    SSE_DONE,
    ProtocolError,
    error_body,
    head_support_complete,
    parse_chat_logprobs,
    parse_completion_logprobs,
    narrow_entries,
    parse_token_id,
    sse,
)
from prodrl_pipelines.engines.server import KEEP_ALIVE_S
from prodrl_pipelines.recorder.ingest import Ingestor, Stats
from prodrl_pipelines.trajectories.blobstore import LocalBlobStore
from prodrl_pipelines.trajectories.store import TrajectoryStore

__all__ = ["RecorderConfig", "Recorder", "build_recorder_app", "add_record_parser", "cmd_record", "TOKEN_ENV"]

TOKEN_ENV = "PRODRL_RECORDER_TOKEN"
UPSTREAM_KEY_ENV = "PRODRL_UPSTREAM_API_KEY"
GREEDY_EPS = 1e-5
_TRAJ_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")


@dataclass
class RecorderConfig:
    upstream: str
    store_dir: str  # local store directory ("" when the store is on S3)
    token: str
    wal_dir: str | None = None  # default: <store_dir>/_recorder/wal (required with an S3 store)
    top_logprobs: int = 20  # K recorded per generated position
    upstream_max_logprobs: int = 20  # the upstream's --max-logprobs
    policy_version: str | None = None
    tokenizer_dir: str | None = None
    upstream_api_key: str | None = None
    flush_rows: int = 1024
    flush_interval_s: float = 2.0
    upstream_timeout_s: float = 120.0
    # Idle upstream connections are reused for at most this long: below the upstream's own keep-alive
    # timeout (vLLM and uvicorn: 5 s), else a reused connection can be closed under a request.
    upstream_keepalive_s: float = 3.0
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    default_top_k: int = 0
    s3_bucket: str = ""  # set: Parquet parts go to s3://<s3_bucket>/<s3_prefix>/ (the WAL stays local)
    s3_prefix: str = ""
    s3_endpoint_url: str = ""  # empty: AWS; else an S3-compatible server (MinIO, moto, ...)
    s3_region: str = ""
    record_extra_draw: bool = False  # ask the upstream for the extra draw a' ~ mu (``extra_token_ids``)

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError(f"the recorder needs a bearer token (set {TOKEN_ENV})")
        if bool(self.store_dir) == bool(self.s3_bucket):
            raise ValueError("the recorder needs exactly one trajectory store: a local directory (--store) "
                             "or an S3 bucket (--s3-bucket)")
        if self.s3_bucket and not self.wal_dir:
            raise ValueError("with an S3 trajectory store the write-ahead log needs a local --wal-dir")
        if self.top_logprobs < 1 or self.top_logprobs > self.upstream_max_logprobs:
            raise ValueError(f"top_logprobs must be in [1, upstream_max_logprobs={self.upstream_max_logprobs}], "
                             f"got {self.top_logprobs}")
        self.upstream = self.upstream.rstrip("/")
        if self.upstream.endswith("/v1"):
            self.upstream = self.upstream[: -len("/v1")]

    def blob_store(self):
        """The ``BlobStore`` the Parquet parts go to (local directory or S3)."""
        if self.s3_bucket:
            from prodrl_pipelines.trajectories.s3 import S3BlobStore

            return S3BlobStore(self.s3_bucket, self.s3_prefix, endpoint_url=self.s3_endpoint_url or None,
                               region=self.s3_region or None)
        return LocalBlobStore(self.store_dir)

    @property
    def wal_path(self) -> str:
        return self.wal_dir or str(Path(self.store_dir) / "_recorder" / "wal")


class TokenStrings:
    """Token id -> vLLM's token string (``tokenizer.decode([id])``), and text of id lists."""

    def __init__(self, tokenizer_dir: str | os.PathLike) -> None:
        path = Path(tokenizer_dir)
        self._cache: dict[int, str] = {}
        cfg = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        self._cleanup = bool(cfg.get("clean_up_tokenization_spaces", False))
        if (path / "tokenizer.json").is_file():  # light: no transformers import
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            self._decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)
        else:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path))
            self._decode = lambda ids: hf.decode(list(ids), skip_special_tokens=False)

    def text(self, ids) -> str:
        s = self._decode(ids)
        if self._cleanup:  # transformers' clean_up_tokenization
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                s = s.replace(a, b)
        return s

    def piece(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = self.text([tid])
        return s


# ----------------------------------------------------------------------------- request analysis


@dataclass
class Ask:
    """What the client asked for (so the recorder can strip what it added)."""

    token_ids: bool
    n: int | None  # logprobs / top_logprobs asked for; None: no logprobs
    as_ids: bool
    prompt_text: bool
    extra: bool = False  # the prodrl extension ``extra_draw``


class Unrecordable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def client_ask(body: dict, kind: str) -> Ask:
    if kind == "completion":
        n = body.get("logprobs")
        n = int(n) if _is_int(n) else None
    elif body.get("logprobs"):
        t = body.get("top_logprobs") or 0
        n = int(t) if _is_int(t) else 0
    else:
        n = None
    return Ask(bool(body.get("return_token_ids")), n, bool(body.get("return_tokens_as_token_ids")),
               bool(body.get("return_prompt_text")), bool(body.get(EXTRA_DRAW_FIELD)))


_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}
_UNSUPPORTED = ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar", "logprob_token_ids", "prompt_embeds",
                "logits_processors", "vllm_xargs")


def unrecordable_reason(body: dict, kind: str) -> str | None:
    """Why a request cannot give a trainable record (None: it can)."""
    for name, typ in (("temperature", _is_num), ("top_p", _is_num), ("top_k", _is_int), ("n", _is_int)):
        if body.get(name) is not None and not typ(body[name]):
            return "invalid_request"
    if kind == "completion":
        if body.get("logprobs") is not None and not _is_int(body["logprobs"]):
            return "invalid_request"
        p = body.get("prompt")
        if isinstance(p, list) and p and not all(_is_int(x) for x in p):
            if len(p) != 1:
                return "multiple_prompts"
        elif not isinstance(p, (str, list)):
            return "invalid_request"
        if body.get("echo"):
            return "echo"
        if (body.get("best_of") or 1) != 1:
            return "best_of"
    else:
        if not isinstance(body.get("messages"), list):
            return "invalid_request"
        if body.get("top_logprobs") is not None and not _is_int(body["top_logprobs"]):
            return "invalid_request"
        rf = body.get("response_format")
        if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
            return "unsupported:response_format"
        tc = body.get("tool_choice")
        if body.get("tools") and (tc == "required" or isinstance(tc, dict)):  # forced tool calls: guided decoding
            return "unsupported:tool_choice"
    if (body.get("n") or 1) != 1:
        return "n>1"
    if body.get("use_beam_search"):
        return "beam_search"
    if body.get("temperature") is not None and body["temperature"] < GREEDY_EPS:
        return "greedy"
    for name, neutral in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and (not _is_num(v) or float(v) != neutral):
            return f"unsupported:{name}"
    for name in _UNSUPPORTED:
        if body.get(name):
            return f"unsupported:{name}"
    return None


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
        self.error: Any = None
        self.extra_choices = False

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
                self.text.append((ch.get("delta") or {}).get("content") or "")
            if ch.get("token_ids") is not None:
                self.have_ids = True
                self.ids.extend(ch["token_ids"])
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

    def answer(self) -> dict:
        text = "".join(self.text)
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "prompt_token_ids": self.prompt_ids,
                      "token_ids": self.ids if self.have_ids else None,
                      "logprobs": self.comp_lp if self.have_lp else None, "finish_reason": self.finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "token_ids": self.ids if self.have_ids else None,
                      "logprobs": {"content": self.chat_lp} if self.have_lp else None, "finish_reason": self.finish}
        if self.have_extra:
            choice[EXTRA_IDS_FIELD] = self.extra
        if self.kind == "completion":
            return {"model": self.model, "choices": [choice]}
        return {"model": self.model, "prompt_token_ids": self.prompt_ids, "prompt_text": self.prompt_text,
                "choices": [choice]}


# ----------------------------------------------------------------------------- the service


class Recorder:
    """State of one recorder process: config, ingest, upstream client, counters."""

    def __init__(self, config: RecorderConfig) -> None:
        self.cfg = config
        self.stats = Stats()
        self.store = TrajectoryStore(config.blob_store())
        self.ingestor = Ingestor(self.store, config.wal_path, flush_rows=config.flush_rows,
                                 flush_interval_s=config.flush_interval_s, stats=self.stats)
        self.tokens = TokenStrings(config.tokenizer_dir) if config.tokenizer_dir else None
        self.http: aiohttp.ClientSession | None = None
        k = config.top_logprobs
        self.chat_n = min(k + 1, config.upstream_max_logprobs)  # top_logprobs asked on chat
        self.chat_k = min(k, self.chat_n - 1) if self.chat_n > 1 else 1

    async def start(self) -> None:
        self.ingestor.recover()
        self.ingestor.attach_loop(asyncio.get_running_loop())
        self.ingestor.start()
        headers = {"Authorization": f"Bearer {self.cfg.upstream_api_key}"} if self.cfg.upstream_api_key else {}
        t = self.cfg.upstream_timeout_s
        # aiohttp rather than httpx here: httpx's pool scans every connection per request, which cost
        # ~10 ms of CPU per proxied call at concurrency 32 (bench/recorder_overhead.py).
        # Idle connections are dropped after upstream_keepalive_s (< the upstream's keep-alive timeout):
        # aiohttp reuses the longest-idle connection first, so with a longer window it kept handing
        # out connections the upstream was closing (502s at 256 concurrent clients).
        self.http = aiohttp.ClientSession(
            base_url=self.cfg.upstream + "/", headers=headers,
            timeout=aiohttp.ClientTimeout(total=t, connect=min(t, 10.0)),
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=self.cfg.upstream_keepalive_s),
            auto_decompress=True)
        self.stream_timeout = aiohttp.ClientTimeout(total=None, connect=min(t, 10.0), sock_read=t)

    async def post_upstream(self, path: str, data: bytes, timeout: aiohttp.ClientTimeout | None = None):
        """POST to the upstream; the response is not read yet (use as ``async with`` or release it).

        Retried once when the connection was closed before any answer came back (a keep-alive
        connection the upstream closed as the request went out: aiohttp does not retry POSTs).
        Safe for the records: nothing is recorded before an answer, and the upstream's answer to
        the retry is the one recorded and relayed (a seeded request samples the same tokens).
        """
        assert self.http is not None
        kw = {"timeout": timeout} if timeout is not None else {}
        try:
            return await self.http.post(path, data=data, headers=_JSON, **kw)
        except _RESET_ERRORS as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):  # could not connect at all: no retry
                raise
            self.stats.inc("upstream_retries")
            return await self.http.post(path, data=data, headers=_JSON, **kw)

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close()
        await asyncio.get_running_loop().run_in_executor(None, self.ingestor.stop)

    # ------------------------------------------------------------------ helpers

    def force(self, body: dict, kind: str, ask: Ask) -> dict:
        up = dict(body)
        up["return_token_ids"] = True
        up["return_tokens_as_token_ids"] = True
        if kind == "completion":
            up["logprobs"] = max(self.cfg.top_logprobs, ask.n or 0)
        else:
            up["logprobs"] = True
            up["top_logprobs"] = max(self.chat_n, ask.n or 0)
            up["return_prompt_text"] = True
        if self.cfg.record_extra_draw:
            up[EXTRA_DRAW_FIELD] = True
        if up.get("temperature") is None:
            up["temperature"] = self.cfg.default_temperature
        if up.get("top_p") is None:
            up["top_p"] = self.cfg.default_top_p
        if up.get("top_k") is None:
            up["top_k"] = self.cfg.default_top_k if self.cfg.default_top_k > 0 else -1
        return up

    def build_row(self, kind: str, data: dict, up: dict, policy_version: str | None, task_id: str | None) -> dict:
        """A CALL_SCHEMA row (without trajectory_id/call_index/created_at) or ``Unrecordable``."""
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise Unrecordable("upstream_malformed") from None
        prompt_ids = choice.get("prompt_token_ids") if kind == "completion" else data.get("prompt_token_ids")
        ids = choice.get("token_ids")
        if prompt_ids is None or ids is None:
            raise Unrecordable("upstream_missing_token_ids")
        if not ids:
            raise Unrecordable("empty_generation")
        if choice.get("logprobs") is None:
            raise Unrecordable("upstream_missing_logprobs")
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise Unrecordable(f"finish_reason_{finish}")
        ids = [int(t) for t in ids]
        try:
            if kind == "completion":
                k = self.cfg.top_logprobs
                lps, hid, hlp = parse_completion_logprobs(choice["logprobs"], ids, int(up["logprobs"]), k)
            else:
                k = self.chat_k
                lps, hid, hlp = parse_chat_logprobs(choice["logprobs"], ids, k)
        except (ProtocolError, KeyError, TypeError, ValueError):
            raise Unrecordable("upstream_bad_logprobs") from None
        top_k = int(up.get("top_k") or 0)
        top_k = top_k if top_k > 0 else 0
        if kind == "completion":
            out_text = choice.get("text") or ""
            prompt_text = up["prompt"] if isinstance(up.get("prompt"), str) else None
            if isinstance(up.get("prompt"), list) and len(up["prompt"]) == 1 and isinstance(up["prompt"][0], str):
                prompt_text = up["prompt"][0]
        else:
            out_text = (choice.get("message") or {}).get("content") or ""
            prompt_text = data.get("prompt_text")
        if prompt_text is None and self.tokens is not None:
            prompt_text = self.tokens.text(prompt_ids)
        extra = self._extra_ids(choice, len(ids)) if up.get(EXTRA_DRAW_FIELD) else None
        return {
            "task_id": task_id,
            "policy_version": policy_version or self.cfg.policy_version or str(data.get("model") or "unknown"),
            "prompt_token_ids": [int(t) for t in prompt_ids],
            "output_token_ids": ids,
            "output_logprobs": lps,
            "top_token_ids": hid,
            "top_logprobs": hlp,
            "support_complete": head_support_complete(top_k, k, hlp),
            "temperature": float(up["temperature"]),
            "top_p": float(up["top_p"]),
            "top_k": top_k,
            "extra_token_ids": extra,
            "prompt_text": prompt_text or "",
            "output_text": out_text,
        }

    def _extra_ids(self, choice: dict, n: int) -> list[int] | None:
        """The choice's extra draw (one id per generated token), or None (counted) when the upstream
        did not return a usable one: the call is still recorded, without it."""
        extra = choice.get(EXTRA_IDS_FIELD)
        if extra is None:
            self.stats.inc("extra_draw_missing")
            return None
        if not isinstance(extra, list) or len(extra) != n or not all(_is_int(t) and t >= 0 for t in extra):
            self.stats.inc("extra_draw_malformed")
            return None
        self.stats.inc("extra_draw_recorded")
        return extra

    def time_call(self, before: float, upstream: float, after: float, commit: float) -> None:
        """Add one answered (non-streamed) call's time split to the ``time_us.*`` counters (and
        ``timed_calls``): in the handler before the upstream request, waiting for the upstream,
        parsing / building the record / rewriting the answer, and waiting for the WAL fsync. The
        recorder's own share is all but ``upstream`` (plus what uvicorn spends outside the handler).
        """
        self.stats.add_many((("time_us.before_upstream", int(before * 1e6)), ("time_us.upstream", int(upstream * 1e6)),
                             ("time_us.after_upstream", int(after * 1e6)), ("time_us.commit_wait", int(commit * 1e6)),
                             ("timed_calls", 1)))

    async def commit(self, tid: str, row: dict | None, reason: str | None) -> int:
        """Durably commit a recorded row or a skip; returns the call index."""
        if row is not None:
            index, fut = self.ingestor.commit_call(tid, row)
            await fut
            self.stats.inc("recorded_calls")
        else:
            index, fut = self.ingestor.commit_skip(tid, reason or "unknown")
            await fut
            self.stats.inc(f"unrecordable.{reason}")
            self.stats.inc("unrecordable_calls")
        return index


def _err(message: str, status: int, stats: Stats | None = None, counter: str | None = None,
         headers: dict | None = None) -> JSONResponse:
    if stats is not None and counter:
        stats.inc(counter)
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


_JSON = {"Content-Type": "application/json"}
# The connection went away under a request (retried once, see Recorder.post_upstream).
_RESET_ERRORS = tuple(e for e in (getattr(aiohttp, "ServerDisconnectedError", None), getattr(aiohttp, "ClientOSError", None),
                                  getattr(aiohttp, "ClientConnectionResetError", None)) if e is not None)


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    return body


def _trajectory_id(request: Request) -> str:
    tid = request.headers.get("x-trajectory-id")
    if tid is None:
        return uuid.uuid4().hex
    if not _TRAJ_ID.match(tid):
        raise ProtocolError("X-Trajectory-Id must be 1-256 characters of [A-Za-z0-9._:@/+=-]")
    return tid


def _n_up(up: dict, kind: str) -> int | None:
    n = up.get("logprobs") if kind == "completion" else up.get("top_logprobs")
    return int(n) if _is_int(n) else None


async def _proxy(request: Request, kind: str) -> Response:
    rec: Recorder = request.app.state.recorder
    stats = rec.stats
    stats.inc("requests")
    t0 = time.perf_counter()
    try:
        body = await _body(request)
        tid = _trajectory_id(request)
    except ProtocolError as exc:
        return _err(str(exc), 400, stats, "bad_requests")
    pv = request.headers.get("x-policy-version")
    task_id = request.headers.get("x-task-id")
    if (pv is not None and not 0 < len(pv) <= 256) or (task_id is not None and len(task_id) > 1024):
        return _err("X-Policy-Version must be 1-256 characters, X-Task-Id at most 1024", 400, stats, "bad_requests")
    ask = client_ask(body, kind)
    reason = unrecordable_reason(body, kind)
    up = body if reason else rec.force(body, kind, ask)
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    headers = {"X-Trajectory-Id": tid}
    assert rec.http is not None
    if body.get("stream"):
        return await _proxy_stream(rec, kind, path, up, ask, reason, tid, pv, task_id)
    t1 = time.perf_counter()
    try:
        async with await rec.post_upstream(path.lstrip("/"), _dumps(up)) as resp:
            content = await resp.read()
            status, ctype = resp.status, resp.headers.get("content-type")
    except asyncio.TimeoutError:
        return _err("the upstream server timed out", 504, stats, "upstream_timeouts", headers)
    except aiohttp.ClientError as exc:
        return _err(f"the upstream server is unreachable: {exc}", 502, stats, "upstream_unreachable", headers)
    t2 = time.perf_counter()
    if status != 200:
        stats.inc("upstream_errors")
        return Response(content, status_code=status, headers=headers, media_type=ctype)
    try:
        data = json.loads(content)
    except ValueError:
        return _err("the upstream answer is not JSON", 502, stats, "upstream_bad_answers", headers)
    row = None
    if reason is None:
        try:
            row = rec.build_row(kind, data, up, pv, task_id)
        except Unrecordable as u:
            reason = u.reason
    answer = Rewriter(kind, ask, rec.tokens, stats, _n_up(up, kind)).rewrite(data) if up is not body else data
    payload = _dumps(answer)
    t3 = time.perf_counter()
    try:
        index = await rec.commit(tid, row, reason)
    except Exception as exc:  # the WAL failed: the client must not believe the call was recorded
        return _err(f"the call could not be recorded durably: {exc}", 503, stats, "commit_failures", headers)
    rec.time_call(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
    headers.update({"X-Call-Index": str(index), "X-Prodrl-Recorded": "true" if row is not None else "false"})
    return Response(payload, media_type="application/json", headers=headers)


async def _proxy_stream(rec: Recorder, kind, path, up, ask, reason, tid, pv, task_id) -> Response:
    stats = rec.stats
    headers = {"X-Trajectory-Id": tid}
    assert rec.http is not None
    try:
        resp = await rec.post_upstream(path.lstrip("/"), _dumps(up), rec.stream_timeout)
    except asyncio.TimeoutError:
        return _err("the upstream server timed out", 504, stats, "upstream_timeouts", headers)
    except aiohttp.ClientError as exc:
        return _err(f"the upstream server is unreachable: {exc}", 502, stats, "upstream_unreachable", headers)
    if resp.status != 200:
        try:
            content = await resp.read()
        finally:
            resp.release()
        stats.inc("upstream_errors")
        return Response(content, status_code=resp.status, headers=headers, media_type=resp.headers.get("content-type"))
    rewriter = Rewriter(kind, ask, rec.tokens, stats, _n_up(up, kind)) if reason is None else None
    acc = StreamAccumulator(kind)

    async def events():
        done = False
        try:
            async for raw in resp.content:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    yield (line + "\n\n").encode()
                    continue
                acc.add(chunk)
                yield sse(rewriter.rewrite(chunk) if rewriter is not None else chunk)
        except asyncio.TimeoutError:
            stats.inc("upstream_timeouts")
            yield sse(error_body("the upstream server timed out", 504))
            yield SSE_DONE
            return
        except aiohttp.ClientError as exc:
            stats.inc("upstream_unreachable")
            yield sse(error_body(f"the upstream stream failed: {exc}", 502))
            yield SSE_DONE
            return
        finally:
            resp.close()
        if not done or acc.error is not None:  # the upstream failed mid-stream: not a call
            stats.inc("upstream_errors")
            yield SSE_DONE
            return
        row, why = None, reason
        if why is None:
            if acc.extra_choices:
                why = "n>1"
            else:
                try:
                    row = rec.build_row(kind, acc.answer(), up, pv, task_id)
                except Unrecordable as u:
                    why = u.reason
        try:
            index = await rec.commit(tid, row, why)
        except Exception as exc:
            stats.inc("commit_failures")
            yield sse(error_body(f"the call could not be recorded durably: {exc}", 503))
            yield SSE_DONE
            return
        yield f": prodrl trajectory_id={tid} call_index={index} recorded={'true' if row else 'false'}\n\n".encode()
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


async def completions(request: Request) -> Response:
    return await _proxy(request, "completion")


async def chat_completions(request: Request) -> Response:
    return await _proxy(request, "chat")


async def models(request: Request) -> Response:
    rec: Recorder = request.app.state.recorder
    assert rec.http is not None
    try:
        async with rec.http.get("v1/models") as resp:
            return Response(await resp.read(), status_code=resp.status, media_type=resp.headers.get("content-type"))
    except asyncio.TimeoutError:
        return _err("the upstream server timed out", 504, rec.stats, "upstream_timeouts")
    except aiohttp.ClientError as exc:
        return _err(f"the upstream server is unreachable: {exc}", 502, rec.stats, "upstream_unreachable")


async def feedback(request: Request) -> Response:
    rec: Recorder = request.app.state.recorder
    stats = rec.stats
    try:
        body = await _body(request)
    except ProtocolError as exc:
        return _err(str(exc), 400, stats, "feedback_bad_requests")
    tid, reward, source = body.get("trajectory_id"), body.get("reward"), body.get("source", "feedback")
    if not isinstance(tid, str) or not tid:
        return _err("`trajectory_id` (a non-empty string) is required", 422, stats, "feedback_invalid")
    if not _is_num(reward) or not math.isfinite(float(reward)):
        return _err(f"`reward` must be a finite number, got {reward!r}", 422, stats, "feedback_invalid")
    if not isinstance(source, str) or not source:
        return _err("`source` must be a non-empty string", 422, stats, "feedback_invalid")
    if not rec.ingestor.known(tid):
        return _err(f"unknown trajectory {tid!r}: no call was recorded under it", 404, stats,
                    "feedback_unknown_trajectory")
    created, fut = rec.ingestor.commit_reward(tid, float(reward), source)
    try:
        await fut
    except Exception as exc:
        return _err(f"the reward could not be recorded durably: {exc}", 503, stats, "commit_failures")
    stats.inc("rewards_recorded")
    return JSONResponse({"trajectory_id": tid, "reward": float(reward), "source": source, "created_at_us": created})


async def stats_route(request: Request) -> Response:
    rec: Recorder = request.app.state.recorder
    return JSONResponse({"counters": rec.stats.as_dict(), "policy_version": rec.cfg.policy_version,
                         "upstream": rec.cfg.upstream, "top_logprobs": rec.cfg.top_logprobs,
                         "chat_top_logprobs": rec.chat_k, "record_extra_draw": rec.cfg.record_extra_draw})


async def metrics(request: Request) -> Response:
    rec: Recorder = request.app.state.recorder
    lines = []
    for name, value in rec.stats.as_dict().items():
        metric = "prodrl_recorder_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)
        lines.append(f"# TYPE {metric} counter\n{metric} {value}")
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


class _BearerAuth:
    """Every route needs ``Authorization: Bearer <token>``; others get 401 and are not recorded."""

    def __init__(self, app, token: str, stats: Stats) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.stats = stats

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                self.stats.inc("unauthorized")
                resp = JSONResponse(error_body("missing or wrong bearer token", 401), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_recorder_app(config: RecorderConfig) -> Starlette:
    rec = Recorder(config)

    @asynccontextmanager
    async def lifespan(app):
        await rec.start()  # replays the WAL before the server accepts connections
        try:
            yield
        finally:
            await rec.stop()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/feedback", feedback, methods=["POST"]),
        Route("/stats", stats_route, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.recorder = rec
    app.add_middleware(_BearerAuth, token=config.token, stats=rec.stats)
    return app


# ----------------------------------------------------------------------------- CLI


def add_record_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("record", help="recording proxy in front of a vLLM-compatible server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--upstream", required=True, help="base URL of the vLLM-compatible server")
    r.add_argument("--store", default="", help="trajectory store directory (or --s3-bucket)")
    r.add_argument("--s3-bucket", default="", help="trajectory store on S3: the bucket (instead of --store; "
                   "needs --wal-dir; credentials from the boto3 default chain)")
    r.add_argument("--s3-prefix", default="", help="key prefix of the S3 trajectory store")
    r.add_argument("--s3-endpoint-url", default="", help="S3-compatible endpoint (MinIO, moto, ...); default AWS")
    r.add_argument("--s3-region", default="", help="S3 region (default: the boto3 default, else us-east-1)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8100)
    r.add_argument("--wal-dir", default=None, help="write-ahead log directory, on local disk "
                   "(default <store>/_recorder/wal; required with --s3-bucket)")
    r.add_argument("--policy-version", default=None, help="policy version of the calls (default: upstream model)")
    r.add_argument("--tokenizer", default=None, help="the served model's tokenizer dir (token strings)")
    r.add_argument("--top-logprobs", type=int, default=20, help="K: head size recorded per position")
    r.add_argument("--upstream-max-logprobs", type=int, default=20, help="the upstream's --max-logprobs")
    r.add_argument("--flush-rows", type=int, default=1024, help="flush to Parquet after this many records")
    r.add_argument("--flush-interval", type=float, default=2.0, help="... or after this many seconds")
    r.add_argument("--upstream-timeout", type=float, default=120.0, help="seconds before a 504")
    r.add_argument("--upstream-keepalive", type=float, default=3.0,
                   help="reuse an idle upstream connection for at most this many seconds (keep it below the "
                        "upstream's keep-alive timeout: 5 s for vLLM)")
    r.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                   help="seconds an idle client connection stays open (above the clients' reuse window)")
    r.add_argument("--record-extra-draw", action="store_true",
                   help="also ask the upstream for the extra draw a' ~ mu (prodrl serve's `extra_draw` extension) "
                        "and record it as extra_token_ids (null and counted when the upstream has none, e.g. vLLM)")
    r.add_argument("--log-level", default="warning")
    r.set_defaults(fn=cmd_record)
    return r


def cmd_record(args) -> int:
    import uvicorn

    token = os.environ.get(TOKEN_ENV)
    if not token:
        print(f"prodrl record: set {TOKEN_ENV} to the bearer token clients must send", file=sys.stderr)
        return 2
    try:
        cfg = RecorderConfig(
            upstream=args.upstream, store_dir=args.store, token=token, wal_dir=args.wal_dir,
            top_logprobs=args.top_logprobs, upstream_max_logprobs=args.upstream_max_logprobs,
            policy_version=args.policy_version, tokenizer_dir=args.tokenizer,
            upstream_api_key=os.environ.get(UPSTREAM_KEY_ENV), flush_rows=args.flush_rows,
            flush_interval_s=args.flush_interval, upstream_timeout_s=args.upstream_timeout,
            s3_bucket=args.s3_bucket, s3_prefix=args.s3_prefix, s3_endpoint_url=args.s3_endpoint_url,
            s3_region=args.s3_region, record_extra_draw=args.record_extra_draw,
            upstream_keepalive_s=args.upstream_keepalive,
        )
    except ValueError as e:
        print(f"prodrl record: {e}", file=sys.stderr)
        return 2
    app = build_recorder_app(cfg)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=10, timeout_keep_alive=args.timeout_keep_alive)
    return 0

