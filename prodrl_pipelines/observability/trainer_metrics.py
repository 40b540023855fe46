"""The trainer's Prometheus metrics while a round trains (prime-rl's trainer gauges): rank 0 serves
``/metrics`` on ``observability.trainer_metrics_port`` for the length of ``loop.train.train``.

``prodrl_trainer_step`` (the optimizer's global step), ``prodrl_trainer_round_step`` (steps of this
round), ``prodrl_trainer_tokens_per_second``, ``prodrl_trainer_loss``, ``prodrl_trainer_grad_norm``,
``prodrl_trainer_engine_mismatch`` (mean |log pi_k - log mu| of the step's tokens: the train-inference
mismatch), ``prodrl_trainer_last_step_timestamp_seconds`` (for "no step for 10 minutes" alerts:
``time() - prodrl_trainer_last_step_timestamp_seconds``), and ``prodrl_trainer_info{round}`` 1.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Gauge, start_http_server

log = logging.getLogger(__name__)

GAUGES = {  # step metric -> (gauge, help)
    "loss": ("prodrl_trainer_loss", "the step's loss"),
    "tokens_per_s": ("prodrl_trainer_tokens_per_second", "the step's trained tokens per second"),
    "grad_norm": ("prodrl_trainer_grad_norm", "the step's gradient norm before clipping"),
    "engine_mismatch": ("prodrl_trainer_engine_mismatch", "mean |log pi_k - log mu| over the step's tokens"),
}


class TrainerMetrics:
    """Serves the gauges from ``start`` to ``close``; ``on_step`` is the trainer's step callback."""

    def __init__(self, round_key: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.gauges = {k: Gauge(name, doc, registry=r) for k, (name, doc) in GAUGES.items()}
        self.step = Gauge("prodrl_trainer_step", "the optimizer's global step", registry=r)
        self.round_step = Gauge("prodrl_trainer_round_step", "optimizer steps taken in this round", registry=r)
        self.last_step = Gauge("prodrl_trainer_last_step_timestamp_seconds", "when the last step ended (unix)",
                               registry=r)
        Gauge("prodrl_trainer_info", "the round being trained", ["round"], registry=r).labels(round_key).set(1)
        self.last_step.set(time.time())  # the round started: its age counts from here until a step ends
        self._server = None
        self._taken = 0
        self._scraped = threading.Condition()
        self._scrapes = 0
        self.registry.register(_ScrapeCounter(self))

    def start(self, host: str, port: int) -> "TrainerMetrics":
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:  # the port is taken: training matters more than its metrics
            log.warning("trainer metrics not served on %s:%s (%s)", host, port, e)
        return self

    def on_step(self, step: int, metrics: dict) -> None:
        """``step``: the optimizer's global step after the step (``rl.trainer.train_round``)."""
        if metrics.get("skipped"):
            return
        for key, gauge in self.gauges.items():
            if key in metrics:
                gauge.set(float(metrics[key]))
        self.step.set(step)
        self._taken += 1
        self.round_step.set(self._taken)
        self.last_step.set(time.time())

    def scraped(self) -> None:
        with self._scraped:
            self._scrapes += 1
            self._scraped.notify_all()

    def close(self, final_scrape_s: float = 0.0) -> None:
        """Stop serving; with ``final_scrape_s``, first wait (at most so long) for a scrape that reads
        the values as they are now."""
        if self._server is not None and final_scrape_s > 0:
            with self._scraped:
                seen = self._scrapes
                self._scraped.wait_for(lambda: self._scrapes > seen, timeout=final_scrape_s)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _ScrapeCounter:
    """A collector with no series: it tells the exporter each time it is scraped."""

    def __init__(self, exporter: TrainerMetrics) -> None:
        self.exporter = exporter

    def collect(self):
        self.exporter.scraped()
        return iter(())
