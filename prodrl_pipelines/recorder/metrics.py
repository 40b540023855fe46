"""The recorder's ``/metrics``: Prometheus text, open like vLLM's (no token, no rate limit).

Three kinds of series, each with bounded labels (route, tenant, version, replica, reason; never a
trajectory id):
- **counters**, every ``Stats`` counter as ``prodrl_recorder_<name>_total`` read at scrape time (the
  hot path keeps its one locked ``Counter``): a per-tenant twin ``tenant.<t>.<name>`` is
  ``prodrl_recorder_tenant_<name>_total{tenant}``, a per-version one ``<name>.version.<v>`` is
  ``prodrl_recorder_<name>_by_version_total{version}``, any other ``<name>.<key>`` is
  ``prodrl_recorder_<name>_total{reason}`` (``time_us.<part>``: ``{part}``);
- **histograms** observed as requests end: the request's time per route, the recorder's own added
  latency per route (request in -> upstream out + upstream done -> response out), the upstream's time
  per replica (series of replicas that left the deployment are dropped), the WAL's group append
  (encode + write + fdatasync) and each entry's wait to be durable;
- **gauges** computed at scrape time: requests in flight (in the recorder and per replica), sealed WAL
  segments waiting for the store, readiness and each of its checks, each replica up or down (group
  stable or canary), and the canary's state.
"""

from __future__ import annotations

import re
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from prodrl_pipelines.recorder.request_context import API_ROUTES, RequestContext

CONTENT_TYPE = CONTENT_TYPE_LATEST
# seconds: a CPU lab call takes 10 ms - 10 s; a proxy's own share is 0.1 - 50 ms
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ADDED_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WAL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# the label a dotted counter's key becomes (``extend_skipped.<why>`` -> reason="<why>")
KEY_LABEL = {"time_us": "part"}
CANARY_STATES = ("none", "running", "paused")


def _metric_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def counter_families(counters: dict[str, int]) -> list[CounterMetricFamily]:
    """``Stats`` counters as Prometheus counter families (see the module's docstring)."""
    fams: dict[str, CounterMetricFamily] = {}

    def fam(name: str, label: str | None) -> CounterMetricFamily:
        metric = "prodrl_recorder_" + _metric_name(name)
        if metric not in fams:
            fams[metric] = CounterMetricFamily(metric, f"recorder counter {name}", labels=[label] if label else None)
        return fams[metric]

    for key, value in counters.items():
        if key.startswith("tenant."):
            tenant, _, name = key[len("tenant."):].partition(".")
            fam("tenant_" + name, "tenant").add_metric([tenant], value)
        elif ".version." in key:
            name, _, version = key.partition(".version.")
            fam(name + "_by_version", "version").add_metric([version], value)
        elif "." in key:  # a plain twin keeps the name: the labelled family is <name>_by_<label>
            name, _, rest = key.partition(".")
            label = KEY_LABEL.get(name, "reason")
            fam(name + f"_by_{label}" if name in counters else name, label).add_metric([rest], value)
        else:
            fam(key, None).add_metric([], value)
    return list(fams.values())


class _ScrapeTime:
    """The registry's collector of what is read when scraped: counters and gauges."""

    def __init__(self, metrics: "RecorderMetrics") -> None:
        self.m = metrics

    def collect(self):
        rec = self.m.recorder
        yield from counter_families(rec.stats.as_dict())
        yield GaugeMetricFamily("prodrl_recorder_requests_in_flight", "API requests being handled",
                                value=self.m.in_flight())
        up_in_flight = GaugeMetricFamily("prodrl_recorder_upstream_requests_in_flight",
                                         "calls waiting on each replica", labels=["replica"])
        for url, n in sorted(rec.balancer.outstanding().items()):
            up_in_flight.add_metric([url], n)
        yield up_in_flight
        yield GaugeMetricFamily("prodrl_recorder_wal_backlog_segments", "sealed WAL segments waiting for the store",
                                value=rec.ingestor.backlog())
        checks = rec.readiness()
        yield GaugeMetricFamily("prodrl_recorder_ready", "1 when /health/ready answers 200",
                                value=float(all(ok for ok, _ in checks.values())))
        check = GaugeMetricFamily("prodrl_recorder_ready_check", "each readiness check (1 ok)", labels=["check"])
        for name, (ok, _) in sorted(checks.items()):
            check.add_metric([name], float(ok))
        yield check
        yield from self._fleet(rec)

    def _fleet(self, rec):
        up = GaugeMetricFamily("prodrl_recorder_replica_up", "each replica of the followed deployment (1 up)",
                               labels=["replica", "group", "version"])
        state = GaugeMetricFamily("prodrl_recorder_canary_state", "the canary's state (one of them is 1)",
                                  labels=["state"])
        now = "none"
        ep = rec.deployment.current() if rec.deployment is not None else None
        if ep is not None:
            stable, canary, _ = rec.balancer.groups(ep)
            paused = rec.balancer.paused_canary(ep)
            down = set(rec.balancer.down())
            for group, choices in (("stable", stable), ("canary", canary or paused)):
                for c in choices:
                    up.add_metric([c.url, group, c.policy_version or ""],
                                  float(c.url not in down and not (group == "canary" and paused)))
            now = "paused" if paused else "running" if canary else "none"
            self.m.keep_replicas({c.url for c in stable + canary + paused})
        for s in CANARY_STATES:
            state.add_metric([s], float(s == now))
        yield up
        yield state


class RecorderMetrics:
    """The recorder's Prometheus registry (one per recorder: tests run several in one process)."""

    def __init__(self, recorder) -> None:
        self.recorder = recorder
        self.registry = CollectorRegistry(auto_describe=False)
        self.request_s = Histogram("prodrl_recorder_request_duration_seconds",
                                   "an API request's time in the recorder, response sent (streams: whole)",
                                   ["route"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self.added_s = Histogram("prodrl_recorder_added_latency_seconds",
                                 "the recorder's own share of a proxied call: request in -> upstream out + "
                                 "upstream done -> response out (WAL commit included)",
                                 ["route"], registry=self.registry, buckets=ADDED_BUCKETS)
        self.upstream_s = Histogram("prodrl_recorder_upstream_duration_seconds",
                                    "a call's time at the upstream: request out -> answer read (streams: last chunk)",
                                    ["replica"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self.wal_append_s = Histogram("prodrl_recorder_wal_append_seconds",
                                      "a group commit of the WAL: encode + write + fdatasync",
                                      registry=self.registry, buckets=WAL_BUCKETS)
        self.wal_wait_s = Histogram("prodrl_recorder_wal_entry_wait_seconds",
                                    "an entry's wait from queued to durable", registry=self.registry,
                                    buckets=WAL_BUCKETS)
        self.responses = Counter("prodrl_recorder_responses", "responses by route and status code",
                                 ["route", "code"], registry=self.registry)
        self.registry.register(_ScrapeTime(self))
        self._in_flight = 0  # changed on the event loop only
        self._replicas_lock = threading.Lock()
        self._replicas: set[str] = set()

    def in_flight(self) -> int:
        return self._in_flight

    def started(self, ctx: RequestContext) -> None:
        """A request came in (``RequestObserver``): API calls count as in flight, probes and scrapes not."""
        if ctx.route in API_ROUTES:
            self._in_flight += 1

    def observe(self, ctx: RequestContext) -> None:
        """A request ended (``RequestObserver``)."""
        self.responses.labels(ctx.route, str(ctx.status)).inc()
        if ctx.route not in API_ROUTES:
            return
        self._in_flight -= 1
        if ctx.tenant is None:  # refused by the token check or the rate limit: counted above, not timed
            return
        self.request_s.labels(ctx.route).observe(ctx.duration_s)
        if ctx.upstream_s is not None:
            self.added_s.labels(ctx.route).observe(ctx.added_s)
            replica = ctx.replica or "upstream"
            with self._replicas_lock:
                self._replicas.add(replica)
            self.upstream_s.labels(replica).observe(ctx.upstream_s)

    def observe_wal(self, append_s: float, waits_s: list[float]) -> None:
        """A WAL group commit (the ingest writer thread)."""
        self.wal_append_s.observe(append_s)
        for w in waits_s:
            self.wal_wait_s.observe(w)

    def keep_replicas(self, current: set[str]) -> None:
        """Drop the upstream histograms of replicas no longer in the deployment (a rolling update
        replaces them: their labels would pile up)."""
        with self._replicas_lock:
            gone = {r for r in self._replicas if r not in current and r != "upstream"}
            self._replicas -= gone
        for r in gone:
            try:
                self.upstream_s.remove(r)
            except KeyError:
                pass

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
