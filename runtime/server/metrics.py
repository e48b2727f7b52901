"""`GET /metrics`: Prometheus text with vLLM's metric names, so existing dashboards read it,
plus `kvdeck:` metrics for what vLLM does not export.

Gauges and counters are read from the engine at scrape time; latency histograms are observed
on the engine thread as each request finishes. Speculative-decoding metrics are not exported:
this runtime has no speculative decoding yet (vLLM omits them too when it is off).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runtime.engine import Engine
from runtime.metrics import request_metrics
from runtime.request import Request
from runtime.snapshot import STATE_NAMES, block_states

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector:
    """Scrape-time view of the engine."""

    def __init__(self, engine: Engine, model: str):
        self.engine = engine
        self.model = model

    def collect(self):
        e, m = self.engine, [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    e.scheduler.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.",
                    e.scheduler.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                    e.kv.usage)
        tree = e.kv.tree
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the cache.",
                      tree.num_query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache.",
                      tree.num_hit_tokens)
        yield counter("vllm:num_preemptions", "Preemptions since start.",
                      e.scheduler.num_preemptions)
        states = block_states(e.kv.pool.refcount, e.kv.pool.cached)
        blocks = GaugeMetricFamily("kvdeck:kv_blocks", "KV blocks by state.",
                                   labels=["model_name", "state"])
        for code, name in enumerate(STATE_NAMES):
            blocks.add_metric([self.model, name], states.count(code))
        yield blocks
        yield counter("kvdeck:kv_evictions", "Prefix-cache blocks evicted.",
                      tree.num_evictions)
        yield counter("kvdeck:kv_cow_copies", "Copy-on-write block copies.",
                      e.kv.num_cow_copies)
        yield gauge("kvdeck:host_tier_bytes", "Bytes of KV on the host tier (no host tier "
                    "yet: always 0).", 0)


class ServerMetrics:
    """The registry behind /metrics for one engine."""

    def __init__(self, engine: Engine, model: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model))
        labels = ["model_name"]
        self.model = model
        h = {"labelnames": labels, "registry": self.registry, "buckets": LATENCY_BUCKETS}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", **h)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", **h)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency.", **h)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time waiting.", **h)
        self.good = Counter("kvdeck:goodput_requests",
                            "Finished requests that met their deadline (if they had one).",
                            labels, registry=self.registry)
        engine.on_finish.append(self.observe)

    def observe(self, req: Request) -> None:
        """Engine thread: record one finished request."""
        m = request_metrics(req)
        if m.ttft is not None:
            self.ttft.labels(self.model).observe(m.ttft)
        for x in m.itls:
            self.itl.labels(self.model).observe(x)
        if m.e2e is not None:
            self.e2e.labels(self.model).observe(m.e2e)
            if m.met_deadline is not False:
                self.good.labels(self.model).inc()
        if m.queue_time is not None:
            self.queue.labels(self.model).observe(m.queue_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
