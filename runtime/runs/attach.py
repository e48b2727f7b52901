"""Reading remote engines' Prometheus metrics: kvdeck, vLLM, SGLang and llama.cpp's server.

`parse_metrics(text)` recognizes the engine by its metric names and returns a
`RemoteStatus` with what that engine exposes; fields it does not expose stay None, and
`missing()` names them so the console can say so instead of drawing zeros. Latency
percentiles are estimated from cumulative histogram buckets (linear within a bucket), the
way Prometheus' `histogram_quantile` does. Metrics text is parsed as data only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from prometheus_client.parser import text_string_to_metric_families

from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.runs.endpoints import server_root
from kvdeck.runtime.server.cascade import CascadeView

# Per engine: our field -> the metric that carries it.
NAMES = {
    "vllm": {
        "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prefix_queries": "vllm:prefix_cache_queries_total",
        "prefix_hits": "vllm:prefix_cache_hits_total",
        "preemptions": "vllm:num_preemptions_total",
        "spec_drafts": "vllm:spec_decode_num_drafts_total",
        "spec_accepted": "vllm:spec_decode_num_accepted_tokens_total",
        "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
        "ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
        "e2e": "vllm:e2e_request_latency_seconds",
        "requests_done": "vllm:request_success_total",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "generation_tokens": "vllm:generation_tokens_total",
    },
    "sglang": {
        "running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
        "kv_usage": "sglang:token_usage", "hit_rate": "sglang:cache_hit_rate",
        "spec_accept_length": "sglang:spec_accept_length",
        "ttft": "sglang:time_to_first_token_seconds",
        "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        "e2e": "sglang:e2e_request_latency_seconds",
        "requests_done": "sglang:num_requests_total",
        "pool_tokens": "sglang:max_total_num_tokens",
        "prompt_tokens": "sglang:prompt_tokens_total",
        "generation_tokens": "sglang:generation_tokens_total",
        "prompt_cached": "sglang:cached_tokens_total",
    },
    "llama.cpp": {
        "running": "llamacpp:requests_processing", "waiting": "llamacpp:requests_deferred",
        # Gone from current builds (kept for older ones); KV usage is then not exposed.
        "kv_usage": "llamacpp:kv_cache_usage_ratio",
        "prompt_cached": "llamacpp:prompt_tokens_cached_total",
        # Current builds count speculative decoding under vLLM's names.
        "spec_drafts": "llamacpp:spec_decode_num_drafts_total",
        "spec_accepted": "llamacpp:spec_decode_num_accepted_tokens_total",
        "spec_draft_tokens": "llamacpp:spec_decode_num_draft_tokens_total",
        "prompt_tokens_per_s": "llamacpp:prompt_tokens_seconds",
        "generated_tokens_per_s": "llamacpp:predicted_tokens_seconds",
        "prompt_tokens": "llamacpp:prompt_tokens_total",
        "generation_tokens": "llamacpp:tokens_predicted_total",
    },
}
LABELS = {"running": "running requests", "waiting": "waiting requests",
          "kv_usage": "KV cache usage", "hit_rate": "prefix-cache hit rate",
          "preemptions": "preemptions", "spec_acceptance": "speculative acceptance",
          "ttft": "TTFT histogram", "itl": "inter-token latency histogram",
          "e2e": "end-to-end latency histogram", "kv_blocks": "KV block states",
          "requests_done": "finished-request count (request rate)",
          "generation_tokens": "generated-token count (throughput)"}


@dataclass
class Histogram:
    """Cumulative buckets (upper bound -> count), sum and count."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    total: float = 0.0
    count: float = 0.0

    def quantile(self, q: float) -> float | None:
        if not self.count or not self.buckets:
            return None
        rank = q * self.count
        prev_bound, prev_count = 0.0, 0.0
        for bound, cum in sorted(self.buckets):
            if cum >= rank:
                if math.isinf(bound):
                    return prev_bound
                inside = cum - prev_count
                frac = (rank - prev_count) / inside if inside else 0.0
                return prev_bound + (bound - prev_bound) * frac
            prev_bound, prev_count = bound, cum
        return prev_bound

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class RemoteStatus:
    """What one scrape of a remote engine says (None: not exposed by that engine)."""

    engine: str
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    hit_rate: float | None = None
    preemptions: float | None = None
    spec_acceptance: float | None = None
    """Accepted draft tokens per draft (vLLM) or mean accepted length (SGLang)."""
    spec_acceptance_rate: float | None = None
    """Accepted / proposed draft tokens (vLLM, kvdeck), when the server counts both."""
    ttft: Histogram | None = None
    itl: Histogram | None = None
    e2e: Histogram | None = None
    kv_blocks: dict[str, float] | None = None
    generated_tokens_per_s: float | None = None
    slots_busy: int | None = None
    """llama.cpp: slots processing a request, from /slots."""
    slots_total: int | None = None
    requests_done: float | None = None
    """Counters since the server started; `Rates` turns two scrapes into per-second rates."""
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    num_gpu_blocks: float | None = None
    """The KV pool in blocks (vLLM's `cache_config_info`)."""
    block_size: float | None = None
    pool_tokens: float | None = None
    """The KV pool in tokens (SGLang's `max_total_num_tokens`; vLLM: blocks × block size)."""
    waiting_reasons: dict[str, float] | None = None
    """Waiting requests by why they wait (vLLM's `num_requests_waiting_by_reason`)."""
    cascade: CascadeView | None = None
    """A kvdeck server's confidence cascade (`kvdeck serve --cascade`): the routing panel."""

    def missing(self) -> list[str]:
        return [LABELS[f.name] for f in fields(self)
                if f.name in LABELS and getattr(self, f.name) is None]


def _collect(text: str) -> tuple[dict[str, float], dict[str, Histogram],
                                 dict[tuple[str, str], float]]:
    scalars: dict[str, float] = {}
    hists: dict[str, Histogram] = {}
    labelled: dict[tuple[str, str], float] = {}
    """(metric, its `state`, `source` or `reason` label) -> value."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise KvdeckError(f"The metrics endpoint did not return Prometheus text ({e}).") \
            from None
    for fam in families:
        for s in fam.samples:
            if fam.type == "histogram":
                h = hists.setdefault(fam.name, Histogram())
                if s.name.endswith("_bucket"):
                    h.buckets.append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_sum"):
                    h.total += s.value
                elif s.name.endswith("_count"):
                    h.count += s.value
            else:
                scalars[s.name] = scalars.get(s.name, 0.0) + s.value
                for label in ("state", "source", "reason"):
                    if label in s.labels:
                        key = (s.name, s.labels[label])
                        labelled[key] = labelled.get(key, 0.0) + s.value
                if s.name == "vllm:cache_config_info":  # an info gauge: its labels are data
                    for label in ("num_gpu_blocks", "block_size"):
                        labelled[(s.name, label)] = _number(s.labels.get(label))
    return scalars, hists, labelled


def parse_metrics(text: str) -> RemoteStatus:
    """Recognize the engine and read its figures; raises KvdeckError for unknown text."""
    scalars, hists, labelled = _collect(text)
    names = set(scalars) | set(hists)
    if any(n.startswith("vllm:") for n in names):
        engine = "kvdeck" if any(n.startswith("kvdeck:") for n in names) else "vllm"
        table = NAMES["vllm"]
    elif any(n.startswith("sglang:") for n in names):
        engine, table = "sglang", NAMES["sglang"]
    elif any(n.startswith("llamacpp:") for n in names):
        engine, table = "llama.cpp", NAMES["llama.cpp"]
    else:
        raise KvdeckError("The metrics come from no engine kvdeck knows (expected vllm:, "
                          "sglang: or llamacpp: names; llama.cpp needs --metrics).")

    def pick(key: str, source: dict):
        want = table.get(key)
        for name in (want,) if isinstance(want, str) else (want or ()):
            if name in source:
                return source[name]
        return None

    st = RemoteStatus(engine)
    st.running, st.waiting = pick("running", scalars), pick("waiting", scalars)
    st.kv_usage, st.preemptions = pick("kv_usage", scalars), pick("preemptions", scalars)
    st.ttft, st.itl, st.e2e = pick("ttft", hists), pick("itl", hists), pick("e2e", hists)
    st.generated_tokens_per_s = pick("generated_tokens_per_s", scalars)
    st.requests_done = pick("requests_done", scalars)
    st.prompt_tokens = pick("prompt_tokens", scalars)
    st.generation_tokens = pick("generation_tokens", scalars)
    queries, hits = pick("prefix_queries", scalars), pick("prefix_hits", scalars)
    by_source = {src: v for (name, src), v in labelled.items()
                 if name == "vllm:prompt_tokens_by_source_total"}
    cached = pick("prompt_cached", scalars)
    # Counted since the server started, the same way on every engine, so replicas compare.
    if sum(by_source.values()):
        # Prompt tokens by where their KV came from: the figure vLLM keeps exact since it
        # fixed an over-count in prefix_cache_hits_total.
        st.hit_rate = by_source.get("local_cache_hit", 0.0) / sum(by_source.values())
    elif cached is not None and st.prompt_tokens:
        st.hit_rate = cached / st.prompt_tokens
    elif queries:
        st.hit_rate = (hits or 0.0) / queries
    else:  # SGLang before its cached-token counter: the last prefill batch's rate
        st.hit_rate = pick("hit_rate", scalars)
    info = {k: v for (name, k), v in labelled.items() if name == "vllm:cache_config_info"}
    st.num_gpu_blocks, st.block_size = info.get("num_gpu_blocks"), info.get("block_size")
    st.pool_tokens = pick("pool_tokens", scalars) or (
        st.num_gpu_blocks * st.block_size if st.num_gpu_blocks and st.block_size else None)
    reasons = {r: v for (name, r), v in labelled.items()
               if name == "vllm:num_requests_waiting_by_reason"}
    st.waiting_reasons = reasons or None
    drafts, accepted = pick("spec_drafts", scalars), pick("spec_accepted", scalars)
    if drafts:
        st.spec_acceptance = (accepted or 0.0) / drafts
    proposed = pick("spec_draft_tokens", scalars)
    if proposed:
        st.spec_acceptance_rate = (accepted or 0.0) / proposed
    st.spec_acceptance = st.spec_acceptance or pick("spec_accept_length", scalars)
    blocks = {state: v for (name, state), v in labelled.items() if name == "kvdeck:kv_blocks"}
    st.kv_blocks = blocks or None
    if engine == "kvdeck" and "kvdeck:cascade_threshold" in scalars:
        st.cascade = CascadeView.from_metrics(text)
    return st


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None  # "None" and the like: not given


@dataclass(frozen=True)
class Rates:
    """Per-second rates between two scrapes of the same server (None where a counter is not
    exposed, or went backwards because the server restarted)."""

    requests_per_s: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    new_preemptions: float | None

    @classmethod
    def between(cls, prev: RemoteStatus, cur: RemoteStatus, dt: float) -> Rates:
        def rate(name: str, per_s: bool = True) -> float | None:
            a, b = getattr(prev, name), getattr(cur, name)
            if a is None or b is None or b < a or dt <= 0:
                return None
            return (b - a) / dt if per_s else b - a
        return cls(rate("requests_done"), rate("prompt_tokens"), rate("generation_tokens"),
                   rate("preemptions", per_s=False))


def metrics_url(url: str) -> str:
    """The /metrics URL of a server's base URL (with or without /v1); a URL that is not
    http(s)://host[:port][/path] is refused with a sentence."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise KvdeckError(f"'{url}' is not a server URL; give one like http://127.0.0.1:8000 "
                          "(http or https, a host, optionally a port).")
    return server_root(url) + "/metrics"


def parse_slots(data: object) -> tuple[int, int]:
    """(busy, total) from llama.cpp's `/slots` JSON: a list of slots with `is_processing`."""
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise KvdeckError("The /slots endpoint did not return a list of slots.")
    return sum(1 for x in data if x.get("is_processing")), len(data)
