"""`GET /metrics`: Prometheus text with vLLM's metric names, so existing dashboards read it,
plus `kvdeck:` metrics for what vLLM does not export.

Everything is read from the engine loop's latest snapshot — counters, gauges, and the
latency histograms the engine keeps (`runtime/stats/figures.py`) — at scrape time; nothing here
touches the scheduler or the KV manager. Speculative-decoding counters use vLLM's names and,
as in vLLM, appear only once speculation has been on.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from kvdeck.runtime.kv.tiers import HOST_STATE_NAMES
from kvdeck.runtime.runs.loop import EngineLoop, SharedBusy
from kvdeck.runtime.server.cascade import CONFIDENCE_BINS, ROUTES, CascadeStats
from kvdeck.runtime.views.snapshot import STATE_NAMES

HISTOGRAMS = (
    ("ttft", "vllm:time_to_first_token_seconds", "Time to first token."),
    ("itl", "vllm:inter_token_latency_seconds", "Inter-token latency."),
    ("e2e", "vllm:e2e_request_latency_seconds", "End-to-end request latency."),
    ("queue", "vllm:request_queue_time_seconds", "Time waiting before admission."),
)


class SnapshotCollector:
    """Scrape-time view of the loop's latest snapshot."""

    def __init__(self, loop: EngineLoop, model: str, adapters: tuple[str, ...] = (),
                 max_loras: int = 0):
        """`adapters`: the LoRA adapters the model serves (`kvdeck serve --lora-modules`),
        at most `max_loras` resident at once (0: all)."""
        self.loop = loop
        self.model = model
        self.adapters = adapters
        self.max_loras = max_loras or len(adapters)

    def collect(self):
        snap = self.loop.latest
        if snap is None:  # the loop has not published yet
            return
        m = [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        kv, figures = snap.kv, snap.figures
        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    len(snap.running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.",
                    len(snap.waiting))
        yield gauge("vllm:kv_cache_usage_perc",
                    "Fraction of KV blocks held by requests (0-1).", kv.usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the cache.",
                      kv.num_query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache.",
                      kv.num_hit_tokens)
        yield counter("vllm:num_preemptions", "Preemptions since start.", snap.num_preemptions)
        if figures is not None:
            yield counter("vllm:prompt_tokens", "Prompt tokens computed (prefill).",
                          figures.prompt_tokens)
            yield counter("vllm:generation_tokens", "Tokens generated.",
                          figures.generation_tokens)
            done = CounterMetricFamily("vllm:request_success", "Requests finished, by reason.",
                                       labels=["model_name", "finished_reason"])
            for status, reason in (("finished_stopped", "stop"),
                                   ("finished_length", "length"), ("aborted", "abort")):
                done.add_metric([self.model, reason], figures.status_counts.get(status, 0))
            yield done
            for key, name, doc in HISTOGRAMS:
                h = figures.histograms[key]
                family = HistogramMetricFamily(name, doc, labels=["model_name"])
                family.add_metric(m, [(f"{b:g}" if b != float("inf") else "+Inf", n)
                                      for b, n in h.cumulative()], h.sum)
                yield family
            yield counter("kvdeck:busy_seconds", "Seconds the engine spent in steps: its "
                          "accelerator's busy time (virtual under the sim executor).",
                          figures.busy_seconds)
            yield counter("kvdeck:goodput_requests",
                          "Finished requests that met their deadline (if they had one) and "
                          "passed their answer check (if they carried one).",
                          figures.num_good)
            yield counter("kvdeck:checked_requests",
                          "Finished answers that carried an answer check.",
                          figures.num_checked)
            yield counter("kvdeck:check_failures",
                          "Finished answers that failed their answer check (finished, not "
                          "good).", figures.num_check_failures)
        yield from self._kv(kv, counter)
        t = snap.transfers
        if t is not None:
            yield from self._transfers(t, gauge, counter)
        v = snap.speculation
        if v is not None and (v.method != "off" or v.drafts):
            yield from self._speculation(v, counter)
        if self.adapters:
            yield self._lora(snap)
        yield gauge("kvdeck:engine_paused", "1 while the operator has paused the engine.",
                    int(snap.paused))
        yield gauge("kvdeck:engine_failed", "1 once the engine stopped on an error.",
                    int(snap.failure is not None))
        yield gauge("kvdeck:sim_lag_seconds", "How far a paced simulation is behind the "
                    "wall clock (0 when keeping up).", snap.lag_s)


    def _kv(self, kv, counter):
        """The pool's blocks by state, and what left it (prefix-cache and token-level
        evictions) or was copied."""
        blocks = GaugeMetricFamily("kvdeck:kv_blocks", "KV blocks by state.",
                                   labels=["model_name", "state"])
        for code, name in enumerate(STATE_NAMES):
            blocks.add_metric([self.model, name], kv.count(code))
        yield blocks
        yield counter("kvdeck:kv_evictions", "Prefix-cache blocks evicted.", kv.num_evictions)
        yield counter("kvdeck:kv_cow_copies", "Copy-on-write block copies.", kv.num_cow_copies)
        if kv.eviction:
            yield counter("kvdeck:kv_token_evicted_blocks", "Blocks token-level eviction "
                          "(--kv-eviction) dropped from requests' tables.", kv.num_evicted_blocks)

    def _lora(self, snap) -> GaugeMetricFamily:
        """vLLM's `lora_requests_info`: the adapters of running and of waiting requests, as
        labels (comma-separated), with the scrape time as the value."""
        def names(views) -> str:
            return ",".join(sorted({v.lora for v in views if v.lora is not None}))

        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "waiting_lora_adapters",
                                         "running_lora_adapters"])
        info.add_metric([str(self.max_loras), names(snap.waiting), names(snap.running)],
                        time.time())
        return info

    def _speculation(self, v, counter):
        """vLLM's speculative-decoding counters (exported, as vLLM does, only when on)."""
        yield counter("vllm:spec_decode_num_drafts", "Speculation rounds (drafts verified).",
                      v.drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      v.draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      v.accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position.",
                                      labels=["model_name", "position"])
        for i, n in enumerate(v.accepted_per_pos[:max(v.num_speculative_tokens,
                                                      len(v.per_position))]):
            per_pos.add_metric([self.model, str(i)], n)
        yield per_pos

    def _transfers(self, t, gauge, counter):
        """The host tier and the device↔host link."""
        c = t.counters
        yield gauge("kvdeck:host_tier_bytes", "KV bytes held in the host tier.", t.host_bytes)
        host = GaugeMetricFamily("kvdeck:host_tier_blocks", "Host-tier KV blocks by state.",
                                 labels=["model_name", "state"])
        for code, name in enumerate(HOST_STATE_NAMES):
            host.add_metric([self.model, name], t.host_states.count(code))
        yield host
        yield gauge("kvdeck:swapped_requests", "Requests whose KV is swapped out to the host.",
                    len(t.swapped_requests))
        yield counter("kvdeck:swap_outs", "Preemptions that swapped KV out to the host.",
                      c["swap_outs"])
        yield counter("kvdeck:swap_ins", "Swapped-out requests copied back.", c["swap_ins"])
        yield counter("kvdeck:prefix_demotions", "Prefix-cache blocks demoted to the host.",
                      c["demotions"])
        yield counter("kvdeck:prefix_host_hits", "Demoted prefix blocks brought back by a hit.",
                      c["promotions"])
        moved = CounterMetricFamily("kvdeck:transfer_bytes", "Bytes copied over the host link.",
                                    labels=["model_name", "direction", "kind"])
        moved.add_metric([self.model, "d2h", "kv"], c["d2h_bytes"])
        moved.add_metric([self.model, "h2d", "kv"], c["h2d_bytes"])
        moved.add_metric([self.model, "h2d", "weights"], c["weight_bytes"])
        yield moved
        yield counter("kvdeck:transfer_seconds", "Time spent copying over the host link.",
                      c["copy_seconds"])
        yield gauge("kvdeck:link_bandwidth_bytes_per_second",
                    "Host link bandwidth, one way (measured at start-up; the hardware "
                    "profile's under the sim executor).", t.link_bandwidth)


class CascadeCollector:
    """The cascade's routing figures (`cascade.py`), as `kvdeck:cascade_*` metrics."""

    def __init__(self, stats: CascadeStats):
        self.stats = stats

    def collect(self):
        s = self.stats
        name = s.config.name
        by_route = {
            "kvdeck:cascade_requests": ("Cascade requests answered, by route.",
                                        lambda r: r.requests),
            "kvdeck:cascade_good_answers": ("Cascade answers that passed their check (or "
                                            "carried none), by route.", lambda r: r.good),
            "kvdeck:cascade_accelerator_seconds": ("Accelerator seconds cascade requests "
                                                   "occupied on both models, by route.",
                                                   lambda r: r.accelerator_s),
            "kvdeck:cascade_latency_seconds": ("Summed end-to-end latency of cascade "
                                               "requests, by route.", lambda r: r.latency_s),
        }
        for metric, (doc, value) in by_route.items():
            family = CounterMetricFamily(metric, doc, labels=["model_name", "route"])
            for route in ROUTES:
                family.add_metric([name, route], value(s.routes[route]))
            yield family
        buckets, total = [], 0
        for bound, n in zip(CONFIDENCE_BINS, s.confidence_counts, strict=True):
            total += n
            buckets.append(("+Inf" if bound == 1.0 else f"{bound:g}", total))
        family = HistogramMetricFamily("kvdeck:cascade_confidence",
                                       f"The small model's confidence in its answer "
                                       f"({s.config.measure}).", labels=["model_name"])
        family.add_metric([name], buckets, s.confidence_sum)
        yield family
        c = s.config
        threshold = GaugeMetricFamily("kvdeck:cascade_threshold",
                                      "Confidence below which the cascade escalates (labels: "
                                      "its models and measure).",
                                      labels=["model_name", "small", "large", "measure"])
        threshold.add_metric([name, c.small, c.large, c.measure], c.threshold)
        yield threshold
        view = s.view()
        yield GaugeMetricFamily("kvdeck:cascade_elapsed_seconds", "Wall seconds since the "
                                "first cascade request.", value=view.elapsed_s)
        if view.saved is not None:
            saved = GaugeMetricFamily("kvdeck:cascade_saved_seconds", "Estimated seconds saved "
                                      "against sending every request to the large model "
                                      "(the large/small ratio measured on escalated ones).",
                                      labels=["model_name", "kind"])
            saved.add_metric([name, "accelerator"], view.saved[0])
            saved.add_metric([name, "latency"], view.saved[1])
            yield saved


class DeviceCollector:
    """`kvdeck:device_busy_seconds`: the served engines' busy time on the device they
    share, each second counted once (`loop.SharedBusy`)."""

    def __init__(self, busy: SharedBusy):
        self.busy = busy

    def collect(self):
        yield CounterMetricFamily("kvdeck:device_busy_seconds", "Wall seconds in which any "
                                  "served engine was stepping (the device they share; with "
                                  "one model, about its busy seconds).",
                                  value=self.busy.seconds)


class ServerMetrics:
    """The registry behind /metrics: every served model's engine loop (each sample labelled
    with its `model_name`, as vLLM labels them) and the cascade's figures."""

    def __init__(self, loops: list[tuple[EngineLoop, str, tuple[str, ...], int]],
                 cascade: CascadeStats | None = None, busy: SharedBusy | None = None):
        """`loops`: (engine loop, model name, its LoRA adapters, max_loras) per served
        model."""
        self.registry = CollectorRegistry()
        self.registry.register(_Merged([SnapshotCollector(*served) for served in loops]))
        if cascade is not None:
            self.registry.register(CascadeCollector(cascade))
        if busy is not None:
            self.registry.register(DeviceCollector(busy))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Merged:
    """Several collectors as one: a metric several of them yield is one family holding all
    their samples (Prometheus' text format allows a name's HELP and TYPE once)."""

    def __init__(self, collectors: list):
        self.collectors = collectors

    def collect(self):
        families: dict[str, object] = {}
        for collector in self.collectors:
            for family in collector.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()
