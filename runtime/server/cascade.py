"""A confidence cascade over two served models: answer with the small one, escalate to the
large one when the small one's answer is unsure or fails its check (chapter 003, "Request
routing": try the small model first; below a confidence threshold, escalate).

Confidence is read from the small model's own token distribution while it answers, one of:

- `min-prob`: the lowest top-1 probability over the answer's tokens (the chapter's
  "softmax probability of the top token"; an answer is as sure as its least sure token);
- `mean-prob`: the geometric mean of the sampled tokens' probabilities, `exp(mean logprob)`
  (the answer's per-token perplexity, inverted).

Both lie in [0, 1], so one threshold range serves both. An answer with no tokens has
confidence 0 (nothing to trust). The statistics kept here are what the routing panel and
`/metrics` show: requests by route, the confidence histogram, accelerator seconds and
latency by route, and good answers by route.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field

from kvdeck.runtime.errors import ConfigError

MEASURES = ("min-prob", "mean-prob")
ROUTES = ("small", "escalated-confidence", "escalated-check")
"""Where a cascade request ended: answered by the small model, or escalated to the large
one because the small answer was unsure, or because it failed its check."""
CONFIDENCE_BINS = tuple(i / 10 for i in range(1, 11))
"""Upper bounds of the confidence histogram's buckets (Prometheus `le`)."""


@dataclass(frozen=True)
class CascadeConfig:
    """`kvdeck serve --cascade SMALL,LARGE`: the model name clients ask for, the two served
    models, and when to escalate."""

    small: str
    large: str
    threshold: float = 0.5
    measure: str = "min-prob"
    name: str = "cascade"

    def __post_init__(self) -> None:
        self.check_knobs(self.threshold, self.measure)
        if self.small == self.large:
            raise ConfigError(f"--cascade needs two different models, got {self.small!r} "
                              "twice.")

    @staticmethod
    def check_knobs(threshold: float, measure: str) -> None:
        """ConfigError for a threshold outside [0, 1] or an unknown measure."""
        if not 0.0 <= threshold <= 1.0:  # NaN fails this too
            raise ConfigError(f"--cascade-threshold must be a probability from 0 to 1, got "
                              f"{threshold}.")
        if measure not in MEASURES:
            raise ConfigError(f"--cascade-confidence must be one of {', '.join(MEASURES)}, "
                              f"got {measure!r}.")

    @classmethod
    def parse(cls, value: str, served: list[str], **knobs) -> CascadeConfig:
        """From `SMALL,LARGE` naming two of the `served` models."""
        names = [v.strip() for v in value.split(",")]
        if len(names) != 2 or not all(names):
            raise ConfigError(f"--cascade takes two served model names, small first, as "
                              f"SMALL,LARGE; got {value!r}.")
        for name in names:
            if name not in served:
                raise ConfigError(f"--cascade names {name!r}, which is not served; the "
                                  f"served models are {', '.join(served)}.")
        config = cls(names[0], names[1], **knobs)
        if config.name in served:
            raise ConfigError(f"The cascade's name {config.name!r} is already a served "
                              "model's; give it another with --cascade-name.")
        return config

    def confidence(self, logprobs: list) -> float:
        """The answer's confidence from its tokens' `TokenLogprobs` (each with its top-1
        alternative: the request asks for `logprobs=1`)."""
        if not logprobs:
            return 0.0
        if self.measure == "min-prob":
            c = min(math.exp(lp.top[0][1] if lp.top else lp.logprob) for lp in logprobs)
        else:
            c = math.exp(sum(lp.logprob for lp in logprobs) / len(logprobs))
        return min(c, 1.0) if c >= 0.0 else 0.0  # NaN logits: nothing to trust

    def route(self, confidence: float, correct: bool | None) -> str:
        """Where an answer with this confidence and check result goes (`correct` is None
        when the request carried no check)."""
        if correct is False:
            return "escalated-check"
        return "small" if confidence >= self.threshold else "escalated-confidence"


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers read text alike: one vocabulary size, end-of-sequence token,
    and the same ids for a probe text (a cascade hands the same prompt to both)."""
    probe = "Cascades route by confidence: 2 + 2 = 4, naïve café, def f(x): return x**2"
    return (a.vocab_size == b.vocab_size and a.eos_token_id == b.eos_token_id
            and a.encode(probe, add_bos=False) == b.encode(probe, add_bos=False))


@dataclass
class RouteFigures:
    """One route's totals."""

    requests: int = 0
    good: int = 0
    accelerator_s: float = 0.0
    """Accelerator seconds its requests occupied, on both models (an escalated request
    spent the small model's too)."""
    latency_s: float = 0.0


@dataclass
class CascadeStats:
    """What the cascade did since the server started: recorded on the server's event loop,
    viewed from the console's thread (`view`), one lock between them."""

    config: CascadeConfig
    routes: dict[str, RouteFigures] = field(
        default_factory=lambda: {r: RouteFigures() for r in ROUTES})
    confidence_counts: list[int] = field(default_factory=lambda: [0] * len(CONFIDENCE_BINS))
    confidence_sum: float = 0.0
    small_s_escalated: float = 0.0
    """Small-model seconds spent on requests that were then escalated."""
    large_s_escalated: float = 0.0
    """Large-model seconds spent on them: with the line above, the measured cost ratio of
    the two models on the same prompts."""
    small_latency_escalated: float = 0.0
    large_latency_escalated: float = 0.0

    started: float | None = None
    """Wall time (monotonic) of the first cascade request."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, route: str, confidence: float, good: bool, small_s: float,
               large_s: float, small_latency: float, large_latency: float) -> None:
        with self.lock:
            self._record(route, confidence, good, small_s, large_s, small_latency,
                         large_latency)

    def _record(self, route: str, confidence: float, good: bool, small_s: float,
                large_s: float, small_latency: float, large_latency: float) -> None:
        if self.started is None:
            self.started = time.monotonic() - small_latency - large_latency
        r = self.routes[route]
        r.requests += 1
        r.good += good
        r.accelerator_s += small_s + large_s
        r.latency_s += small_latency + large_latency
        bucket = next(i for i, b in enumerate(CONFIDENCE_BINS) if confidence <= b)
        self.confidence_counts[bucket] += 1
        self.confidence_sum += confidence
        if route != "small":
            self.small_s_escalated += small_s
            self.large_s_escalated += large_s
            self.small_latency_escalated += small_latency
            self.large_latency_escalated += large_latency

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.routes.values())

    @property
    def escalation_rate(self) -> float:
        n = self.requests
        return (n - self.routes["small"].requests) / n if n else 0.0

    def saved(self) -> tuple[float, float] | None:
        """(accelerator seconds, latency seconds) saved against sending every request to the
        large model alone, or None before any request was escalated: the large model's cost
        on a request the small one answered is estimated by the ratio of the two models'
        measured costs on the escalated requests (the same prompts on both)."""
        if self.small_s_escalated <= 0 or self.small_latency_escalated <= 0:
            return None
        kept = self.routes["small"]
        cost_ratio = self.large_s_escalated / self.small_s_escalated
        latency_ratio = self.large_latency_escalated / self.small_latency_escalated
        return (kept.accelerator_s * (cost_ratio - 1) - self.small_s_escalated,
                kept.latency_s * (latency_ratio - 1) - self.small_latency_escalated)


    def view(self) -> CascadeView:
        """A copy for another thread to show (the console's routing panel)."""
        with self.lock:
            return self._view()

    def _view(self) -> CascadeView:
        elapsed = time.monotonic() - self.started if self.started is not None else 0.0
        return CascadeView(self.config, copy.deepcopy(self.routes),
                           tuple(self.confidence_counts), self.escalation_rate,
                           self.saved(), elapsed)


@dataclass(frozen=True)
class CascadeView:
    """What the routing panel shows: the cascade's settings and figures at one moment."""

    config: CascadeConfig
    routes: dict[str, RouteFigures]
    confidence_counts: tuple[int, ...]
    escalation_rate: float
    saved: tuple[float, float] | None
    elapsed_s: float
    """Wall seconds since the first cascade request (goodput's denominator)."""

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.routes.values())

    @classmethod
    def from_metrics(cls, text: str) -> CascadeView | None:
        """The view a kvdeck server's `/metrics` text carries (`kvdeck attach`), or None
        when it serves no cascade."""
        from prometheus_client.parser import text_string_to_metric_families

        routes = {r: RouteFigures() for r in ROUTES}
        fields = {"kvdeck:cascade_requests_total": "requests",
                  "kvdeck:cascade_good_answers_total": "good",
                  "kvdeck:cascade_accelerator_seconds_total": "accelerator_s",
                  "kvdeck:cascade_latency_seconds_total": "latency_s"}
        config, cumulative, elapsed, saved = None, [], 0.0, {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in fields and s.labels.get("route") in routes:
                    value = s.value if fields[s.name].endswith("_s") else int(s.value)
                    setattr(routes[s.labels["route"]], fields[s.name], value)
                elif s.name == "kvdeck:cascade_threshold":
                    config = CascadeConfig(s.labels["small"], s.labels["large"], s.value,
                                           s.labels["measure"], s.labels["model_name"])
                elif s.name == "kvdeck:cascade_confidence_bucket":
                    cumulative.append(int(s.value))
                elif s.name == "kvdeck:cascade_elapsed_seconds":
                    elapsed = s.value
                elif s.name == "kvdeck:cascade_saved_seconds":
                    saved[s.labels["kind"]] = s.value
        if config is None:
            return None
        counts = tuple(b - a for a, b in zip([0, *cumulative], cumulative, strict=False))
        n = sum(r.requests for r in routes.values())
        rate = (n - routes["small"].requests) / n if n else 0.0
        return cls(config, routes, counts or (0,) * len(CONFIDENCE_BINS), rate,
                   (saved["accelerator"], saved["latency"]) if saved else None, elapsed)


def cascade_cost(escalation_rate: float, cost_ratio: float) -> float:
    """A cascade's cost per request relative to the large model alone: every request pays
    the small model (`cost_ratio` of the large one's cost) and the escalated ones the large
    one too. Chapter 003: 80 % answered by a model ten times cheaper costs 0.1 + 0.2 = 0.3,
    "about 70 %" saved."""
    return cost_ratio + escalation_rate
