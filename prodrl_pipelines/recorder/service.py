"""``prodrl record``: an OpenAI-compatible recording proxy in front of any vLLM-compatible server.

Clients talk to the recorder exactly as to vLLM (``POST /v1/completions``,
``POST /v1/chat/completions``, streaming or not, ``GET /v1/models``). For every call the recorder:

0. with ``--follow FILE`` (the deployment's endpoint file, ``deploy_targets.base``) sends each request
   to the URL and served model name the file holds now (re-read when it changes), so the recorder
   follows blue/green restarts and in-place reloads;
1. adds the recording fields to the upstream request: ``return_token_ids``,
   ``return_tokens_as_token_ids``, ``logprobs`` (completions: K; chat: ``logprobs: true`` and
   ``top_logprobs`` K + 1, at most ``--upstream-max-logprobs``, because vLLM's chat list starts with
   the sampled token and stops at n entries, so n = K + 1 gives an exact top-K head; with n = 20 the
   chat head has 19 entries), ``return_prompt_text`` (chat), and explicit ``temperature`` /
   ``top_p`` / ``top_k`` when the client left them out (``--default-temperature`` / ``--default-top-p``
   / ``--default-top-k``: 1, 1, off) so what is recorded is what was sampled whatever the server's
   generation-config defaults (a client that leaves them out samples as it would directly only when
   these equal the upstream's defaults: vLLM's ``--generation-config vllm`` has 1, 1, off, ``auto``
   takes the model's ``generation_config.json``). None of the recording fields changes what a seeded
   request samples, on vLLM 0.32 (measured: logprobs 0-20, top_logprobs 0-21, token ids as ids or
   not, 20 prompts x 32 tokens, top_k/top_p on and off: 0 of 20 differ) or on ``prodrl serve``;
2. answers the client with the upstream answer, minus what the client did not ask for (token ids,
   logprobs, more top logprobs than asked, token-id strings -- turned back into text with
   ``--tokenizer``, the served model's tokenizer; without it they stay ``token_id:<id>``);
3. records one ``CALL_SCHEMA`` row per call: the exact prompt and output ids, processed logprobs, the
   top-K head (``support_complete`` from the head, see ``head_support_complete``), the sampling
   params, prompt/output text, and the policy version: with ``--follow``, the version that served
   the answer (the deployment endpoint file's version for the model that answered, else the answer's
   served model name; a client's ``X-Policy-Version`` never overrides it), otherwise the
   ``X-Policy-Version`` header, else ``--policy-version``, else the answer's served model name). Rows are fsynced to the write-ahead log
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
... in the order they complete. Without it, a session key groups them: an ``X-Session-Id`` header,
else the session of a session-scoped base URL (every OpenAI route is also served under
``/s/<session>/v1/...``, so ``OpenAI(base_url=".../s/run-42/v1")`` records one agent run as one
trajectory without patching its SDK; ``calls.SESSION_SOURCES``). A call with none of them starts a
new trajectory with a generated id. The answer carries ``X-Trajectory-Id`` and (when not streaming)
``X-Call-Index`` and ``X-Prodrl-Recorded``. Optional ``X-Task-Id`` is stored as ``task_id``.

Rewards: ``POST /v1/feedback {"trajectory_id", "reward", "source"?}`` -> 200 once durable;
unknown trajectory 404; reward missing, not a number or not finite 422; malformed JSON 400.

Every route needs ``Authorization: Bearer <token>`` (401 otherwise; nothing is recorded): one
``PRODRL_RECORDER_TOKEN``, or tenants from ``--tokens-file`` (``tenants``: rotated without a restart,
trajectory ids namespaced per tenant, optional per-tenant rate limit). ``GET /stats`` (JSON) and
``GET /metrics`` (Prometheus text) expose the counters, per tenant too.

Retries: a request that repeats a call the client got no answer to -- the same ``Idempotency-Key``
header, or the same body with a retry count above 0 (``x-stainless-retry-count``, which the openai
client sends) in the same trajectory -- takes the earlier attempt's call index and supersedes its
record (``retried_calls``), so a client's automatic retries add no phantom calls.

Calls that cannot be recorded are still answered, counted (``unrecordable.<reason>``) and take
their call index (see ``ingest``), but are never stored: ``n > 1``, beam search, several prompts in
one request, echo, greedy (temperature < 1e-5: no stochastic policy to correct for), sampling
modifiers the trainer cannot reproduce (penalties, ``min_p``, ``logit_bias``, ``allowed_token_ids``,
``bad_words``, structured outputs...), and upstream answers without token ids or logprobs. Upstream
errors pass through unchanged (counted, not recorded); an upstream timeout is a 504, an unreachable
upstream a 502, and so is a 200 whose body is not an OpenAI answer (naming what is wrong). A stream
that ends before ``[DONE]`` or carries a malformed chunk ends with an SSE error event (502) and is a
failed call: it takes its call index and is stored as skipped (``upstream_stream_cut``,
``upstream_bad_stream``), never as an answer. Client bodies are JSON with integers of at most 20
digits (400 otherwise); ``X-Policy-Version`` names a store directory, so it is at most 200 bytes
URL-encoded (``trajectories.store.name_problem``, 400 otherwise). One process (one uvicorn worker)
per WAL directory.

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

import asyncio
import gc
from pathlib import Path

import aiohttp

from prodrl_pipelines.engines.logprob_parsing import head_support_complete, parse_chat_logprobs, parse_completion_logprobs
from prodrl_pipelines.engines.openai_protocol import (
    EXTRA_DRAW_FIELD,
    EXTRA_IDS_FIELD,
    ROUTED_EXPERTS_FIELD,
    ROUTED_EXPERTS_START_FIELD,
    ProtocolError,
)
from prodrl_pipelines.recorder.balancer import Balancer
from prodrl_pipelines.recorder.config import TOKEN_ENV, UPSTREAM_KEY_ENV, RecorderConfig
from prodrl_pipelines.recorder.counters import Stats
from prodrl_pipelines.recorder.ingest import Attempt, Ingestor
from prodrl_pipelines.recorder.metrics import RecorderMetrics
from prodrl_pipelines.recorder.request_context import note_record
from prodrl_pipelines.recorder.requests import Ask, Unrecordable, is_json_int
from prodrl_pipelines.recorder.tenants import Tenants
from prodrl_pipelines.recorder.upstream_calls import UpstreamCalls
from prodrl_pipelines.recorder.upstream_view import FollowedEndpoint, TokenStrings
from prodrl_pipelines.trajectories import routing
from prodrl_pipelines.trajectories.store import TrajectoryStore

__all__ = ["RecorderConfig", "Recorder", "TokenStrings", "TOKEN_ENV"]



# ----------------------------------------------------------------------------- the service


class Recorder(UpstreamCalls):
    """State of one recorder process: config, ingest, upstream client, counters."""

    def __init__(self, config: RecorderConfig) -> None:
        from prodrl_pipelines.trajectories.store import name_problem

        if config.policy_version is not None and name_problem(config.policy_version, "--policy-version"):
            raise ValueError(name_problem(config.policy_version, "--policy-version"))
        from urllib.parse import urlsplit

        if config.upstream and urlsplit(config.upstream).password is not None and config.upstream_api_key:
            raise ValueError(f"the upstream URL carries credentials and ${UPSTREAM_KEY_ENV} is set: give one of them "
                             "(a bearer token, or user:password in the URL)")
        self.cfg = config
        self.tenants = Tenants(config.token or None, config.tokens_file)  # a bad tokens file fails here
        self.stats = Stats()
        self.store = TrajectoryStore(config.blob_store())
        from prodrl_pipelines.recorder.indexer import make_indexer

        self.metrics = RecorderMetrics(self)
        self.ingestor = Ingestor(self.store, config.wal_path, flush_rows=config.flush_rows,
                                 flush_interval_s=config.flush_interval_s, stats=self.stats,
                                 indexer=make_indexer(config.coordination_url),
                                 on_group_commit=self.metrics.observe_wal)
        self.tokens = TokenStrings(config.tokenizer_dir) if config.tokenizer_dir else None
        self.tokenizer_source = config.tokenizer_dir or ""
        self._tokenizer_retry_at = 0.0
        self.http: aiohttp.ClientSession | None = None
        k = config.top_logprobs
        self.chat_n = min(k + 1, config.upstream_max_logprobs)  # top_logprobs asked on chat
        self.chat_k = min(k, self.chat_n - 1) if self.chat_n > 1 else 1
        self.deployment = FollowedEndpoint(config.follow) if config.follow else None
        # the balancer pauses a canary that keeps refusing connections in the followed endpoint file
        self.balancer = Balancer(endpoints=self.deployment.file if self.deployment is not None else None,
                                 sticky=config.session_affinity)
        self._health: asyncio.Task | None = None
        self.unflushed_segments: int | None = None  # set by stop(): WAL segments not yet in the store
        self._froze = False

    async def start(self) -> None:
        sweep = getattr(self.store.blobs, "sweep_temporaries", None)  # local stores: a killed writer's leftovers
        if sweep is not None:
            self.stats.inc("orphaned_temporaries_removed", sweep())
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
            base_url=None if self.deployment else self.cfg.upstream + "/", headers=headers,
            timeout=aiohttp.ClientTimeout(total=t, connect=min(t, 10.0)),
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=self.cfg.upstream_keepalive_s),
            auto_decompress=True)
        self.stream_timeout = aiohttp.ClientTimeout(total=None, connect=min(t, 10.0), sock_read=t)
        if self.deployment is not None:
            self._health = asyncio.get_running_loop().create_task(self.health_loop())
        await self.find_tokenizer()
        # What start-up loaded (modules, tokenizer, store, replayed WAL) lives as long as the process:
        # kept out of the cyclic GC's full collections, which otherwise re-scan all of it every few
        # hundred calls (the parsed chunks of a streamed call survive long enough to trigger them).
        gc.freeze()
        self._froze = True

    async def find_tokenizer(self) -> None:
        """Without ``--tokenizer``: the served model's own tokenizer, from the deployment's export
        (``--follow``) or the directory the upstream reports as its model's ``root`` (``/v1/models``:
        vLLM and ``prodrl serve`` both give it). Looked for again at most every 30 s until found, so
        a recorder started before its deployment still finds it."""
        import time

        if self.tokens is not None or self.cfg.tokenizer_dir or time.monotonic() < self._tokenizer_retry_at:
            return
        self._tokenizer_retry_at = time.monotonic() + 30.0
        candidates = []
        if self.deployment is not None and (ep := self.deployment.current()) is not None and ep.export_dir:
            candidates.append(ep.export_dir)
        try:
            async with self.http.get(self.upstream_url("v1/models")) as resp:
                models = (await resp.json(content_type=None)).get("data") or []
            candidates += [m.get("root") for m in models if isinstance(m, dict) and isinstance(m.get("root"), str)]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            pass
        for c in candidates:
            if c and ((Path(c) / "tokenizer.json").is_file() or (Path(c) / "tokenizer_config.json").is_file()):
                try:
                    self.tokens = TokenStrings(c)
                except Exception:  # noqa: BLE001 - an unreadable tokenizer: keep looking, stay id strings
                    continue
                self.tokenizer_source = c
                self.stats.inc("tokenizer_found")
                return

    def served_model(self) -> str | None:
        """The model name the followed deployment serves (requests are sent with it), else None."""
        ep = self.deployment.current() if self.deployment is not None else None
        return ep.served_model_name if ep is not None else None

    def version_of(self, answered_model: str | None) -> str:
        """The policy version that served an answer: the version the followed deployment lists for
        the model name that answered (an in-place reload keeps the name; managed servers are named
        after their version), else the answer's own served model name."""
        ep = self.deployment.current() if self.deployment is not None else None
        version = ep.version_of(answered_model) if ep is not None else None
        return version or str(answered_model or "unknown")

    def filed_version(self, header: str | None, answered_model: str | None) -> str:
        """The version a call is filed under. Following a deployment, the recorder knows which version
        answered: that one, whatever a client's ``X-Policy-Version`` says (a tenant cannot file calls
        under the canary or the live version; a header that disagrees is counted). Otherwise the
        header, else ``--policy-version``, else the answer's served model name."""
        if self.deployment is not None:
            served = self.version_of(answered_model)
            if header is not None and header != served:
                self.stats.inc("policy_version_header_ignored")
            return served
        return header or self.cfg.policy_version or self.version_of(answered_model)

    async def health_loop(self, interval_s: float = 1.0) -> None:
        """Check every replica's ``/health``: a failing one is taken out, a healthy one brought back."""
        while True:
            ep = self.deployment.current() if self.deployment is not None else None
            if ep is not None:
                stable, canary, _ = self.balancer.groups(ep)
                for c in stable + canary:
                    try:
                        async with self.http.get(c.url.rstrip("/") + "/health",
                                                 timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                            ok, refused = r.status == 200, None
                    except aiohttp.ClientConnectorError as exc:
                        ok, refused = False, exc
                    except (asyncio.TimeoutError, aiohttp.ClientError):
                        ok, refused = False, None
                    if ok:
                        self.balancer.mark_up(c.url)
                    else:
                        if c.url not in self.balancer.down():
                            self.stats.inc("replica_health_failures")
                        if refused is None:
                            self.balancer.mark_down(c.url)
                        elif self.balancer.refused(c, refused):  # not listening: counts toward a pause
                            self.stats.inc("canary_paused")
                await self._resume_answering_canary(ep)
            await asyncio.sleep(interval_s)

    async def _resume_answering_canary(self, ep) -> None:
        """A paused canary whose server answers ``/health`` again (restarted by Ray or its actor) goes
        back on traffic: a restart is an infrastructure blip, not a verdict on the model."""
        files = self.balancer.endpoints
        for c in self.balancer.paused_canary(ep) if files is not None else []:
            try:
                async with self.http.get(c.url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                    if r.status != 200:
                        continue
            except (asyncio.TimeoutError, aiohttp.ClientError):
                continue
            # the file's lock may be held by a deploy: written off the event loop
            if await asyncio.to_thread(files.resume_canary, c.url, c.policy_version):
                self.balancer.resumed(c)
                self.stats.inc("canary_resumed")
            return

    async def stop(self) -> None:
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._health is not None:
            self._health.cancel()
        if self.deployment is not None:
            self.deployment.close()
        if self.http is not None:
            await self.http.close()
        self.unflushed_segments = await asyncio.get_running_loop().run_in_executor(None, self.ingestor.stop)

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
        if finish not in ("stop", "length", "tool_calls"):  # tool_calls: the model stopped after its calls
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
            out_text = self._chat_output_text(choice, up, ids)
            prompt_text = data.get("prompt_text")
        if prompt_text is None and self.tokens is not None:
            prompt_text = self.tokens.text(prompt_ids)
        extra = self._extra_ids(choice, len(ids)) if up.get(EXTRA_DRAW_FIELD) else None
        routing, routing_start = self._routing(choice, up, len(prompt_ids), len(ids))
        return {
            "task_id": task_id,
            "policy_version": self.filed_version(policy_version, data.get("model")),
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
            "routed_experts": routing,
            "routed_experts_start": routing_start,
            "prompt_text": prompt_text or "",
            "output_text": out_text,
        }

    def _chat_output_text(self, choice: dict, up: dict, ids: list[int]) -> str:
        """A chat reply's text: the message content, unless the request had tools or the server
        parsed the reply (``tool_calls``, ``reasoning``: text taken out of the content); then the text
        of the sampled ids, without the stop token that ended them (finish ``stop`` or
        ``tool_calls``, not by a stop string), so ``<think>`` and ``<tool_call>`` blocks are kept."""
        msg = choice.get("message") or {}
        parsed = bool(msg.get("tool_calls")) or any(msg.get(k) is not None for k in ("reasoning", "reasoning_content"))
        if self.tokens is None or not (up.get("tools") or parsed):
            return msg.get("content") or ""
        stopped = choice.get("finish_reason") in ("stop", "tool_calls") and not isinstance(choice.get("stop_reason"), str)
        return self.tokens.text(ids[:-1] if stopped else ids)

    def _routing(self, choice: dict, up: dict, n_prompt: int, n_out: int) -> tuple[bytes | None, int | None]:
        """The choice's MoE routing (vLLM ``--enable-return-routed-experts``) as the stored blob and
        its first position; (None, None) when the upstream returned none. Routing that cannot be
        decoded or does not fit the call is still stored (raw) and counted: selection quarantines
        it with the reason (``bad_routing``), so a bad upstream is visible, never trained on."""
        value = choice.get(ROUTED_EXPERTS_FIELD)
        if value is None:
            return None, None
        start = up.get(ROUTED_EXPERTS_START_FIELD) or 0
        try:
            arr = routing.from_vllm(value)
            problem = routing.check_fits(arr, n_prompt, n_out, int(start))
            blob = routing.encode_routing(arr)
        except (routing.RoutingError, TypeError, ValueError) as exc:
            problem, blob = str(exc), str(value).encode("utf-8", "replace")
        self.stats.inc("routing_malformed" if problem else "routing_recorded")
        return blob, int(start) if isinstance(start, int) else 0

    def _extra_ids(self, choice: dict, n: int) -> list[int] | None:
        """The choice's extra draw (one id per generated token), or None (counted) when the upstream
        did not return a usable one: the call is still recorded, without it."""
        extra = choice.get(EXTRA_IDS_FIELD)
        if extra is None:
            self.stats.inc("extra_draw_missing")
            return None
        if not isinstance(extra, list) or len(extra) != n or not all(is_json_int(t) and t >= 0 for t in extra):
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

    async def commit(self, tid: str, row: dict | None, reason: str | None, attempt: Attempt | None = None,
                     tenant: str | None = None) -> int:
        """Durably commit a recorded row or a skip; returns the call index. A retry of an earlier
        attempt takes its index and supersedes it (``retried_calls``)."""
        if row is not None:
            index, fut, retried = await self.ingestor.commit_call_async(tid, row, attempt)
            # per served version: a rolling update or a canary shows its mix here
            counters = ["recorded_calls", f"recorded_calls.version.{row['policy_version']}"]
        else:
            index, fut, retried = await self.ingestor.commit_skip_async(tid, reason or "unknown", attempt)
            counters = [f"unrecordable.{reason}", "unrecordable_calls"]
        await fut
        if retried:
            counters.append("retried_calls")
        self.stats.count(*counters, tenant=tenant)
        note_record(tid, row)
        return index

    def readiness(self) -> dict[str, tuple[bool, str]]:
        """What ``/health/ready`` checks (name -> (ok, why)): the WAL and the store, and with
        ``--follow`` that some replica of the deployment answers."""
        checks = dict(self.ingestor.readiness())
        if self.deployment is not None:
            ep = self.deployment.current()
            if ep is None:
                checks["upstream"] = (False, "no deployment yet (bootstrap first)")
            else:
                stable, canary, _ = self.balancer.groups(ep)
                down = set(self.balancer.down())
                up = [c.url for c in stable + canary if c.url not in down]
                checks["upstream"] = (bool(up), f"{len(up)} of {len(stable) + len(canary)} replicas up")
        return checks
