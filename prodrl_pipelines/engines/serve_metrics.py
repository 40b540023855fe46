"""``prodrl serve``'s ``/metrics``: what it has of vLLM's metrics, under vLLM's names and labels, so
that a dashboard built for a vLLM fleet reads it unchanged. Open like vLLM's (its key guards ``/v1``).

- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: requests in an engine call / queued
  for one (the batching loop's view; one engine thread, so "running" is the current batch);
- ``vllm:e2e_request_latency_seconds``: request in -> response sent, per successful generation request;
- ``vllm:time_to_first_token_seconds``: request in -> its generation done (streams are simulated: the
  first chunk goes out once the whole completion is generated, see ``server``);
- ``vllm:request_queue_time_seconds`` and ``vllm:request_inference_time_seconds``: waiting for, and in,
  the engine call;
- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:request_success_total``
  (``finished_reason``: stop or length).
Every series has vLLM's ``model_name`` label (the served model name; a reload changes it).
"""

from __future__ import annotations

import time
from contextvars import ContextVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from prodrl_pipelines.observability.asgi import ObservedRequest

CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's buckets for request latency (seconds)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class ServeMetrics:
    def __init__(self, model_name) -> None:
        """``model_name``: a callable giving the served model name now."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        r, lab = self.registry, ["model_name"]
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "end-to-end request latency", lab, registry=r,
                             buckets=REQUEST_BUCKETS)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "time to first token", lab, registry=r,
                              buckets=TTFT_BUCKETS)
        self.queue = Histogram("vllm:request_queue_time_seconds", "time waiting for the engine", lab, registry=r,
                               buckets=REQUEST_BUCKETS)
        self.inference = Histogram("vllm:request_inference_time_seconds", "time in the engine call", lab,
                                   registry=r, buckets=REQUEST_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prefill tokens processed", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "generation tokens processed", lab, registry=r)
        self.success = Counter("vllm:request_success", "successfully processed requests",
                               lab + ["finished_reason"], registry=r)
        self.running = 0  # prompts in the engine call now (the event loop changes these)
        self.waiting = 0
        self.registry.register(self)

    def collect(self):
        name = self.model_name()
        for metric, doc, value in (("vllm:num_requests_running", "requests in an engine call", self.running),
                                   ("vllm:num_requests_waiting", "requests waiting for the engine", self.waiting)):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            yield g

    # the batching loop's events (engines.batching)
    def queued(self, n: int) -> None:
        self.waiting += n

    def batch_started(self, n: int, waited_s: list[float]) -> None:
        self.waiting -= n
        self.running += n
        h = self.queue.labels(self.model_name())
        for w in waited_s:
            h.observe(w)

    def batch_done(self, n: int, took_s: float, records) -> None:
        self.running -= n
        name = self.model_name()
        h = self.inference.labels(name)
        for _ in range(n):  # per request, as vLLM's: each was in the whole engine call
            h.observe(took_s)
        self.prompt_tokens.labels(name).inc(sum(len(r.prompt_token_ids) for r in records))
        self.generation_tokens.labels(name).inc(sum(len(r.output_token_ids) for r in records))
        for rec in records:
            self.success.labels(name, rec.finish_reason).inc()

    def batch_failed(self, n: int) -> None:
        self.running -= n

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


    # a generation request's span (``observability.asgi.RequestObserver`` in ``server.build_app``)
    def begin(self, scope) -> ObservedRequest | None:
        return ObservedRequest() if scope.get("path") in GENERATION_ROUTES else None

    def first_token(self) -> None:
        """The current request's completions are generated (``serve_plan.run_plan``)."""
        req = CURRENT.get()
        if req is not None:
            self.ttft.labels(self.model_name()).observe(time.perf_counter() - req.t0)

    def done(self, req: ObservedRequest, scope) -> None:
        if req.status == 200:  # errors are not vLLM's successful requests
            self.e2e.labels(self.model_name()).observe(req.duration_s)


GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
CURRENT: ContextVar[ObservedRequest | None] = ContextVar("prodrl_serve_request", default=None)
