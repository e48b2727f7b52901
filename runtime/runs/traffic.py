"""A built-in traffic generator: Poisson arrivals of a mix of short chats and long requests
that share a system prompt, scaled to the model's context.

It is called from the engine's thread before each iteration (`EngineLoop.before_step`) and
submits every arrival due by the engine clock, so it works on the sim executor's virtual clock
and on wall time alike. Deterministic for a seed. Rate and mix are live-tunable.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, replace

from kvdeck.runtime.core.config import check_float
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.errors import KvdeckError


@dataclass(frozen=True)
class TrafficMix:
    """Arrival rate and request shapes; lengths are fractions of the model context."""

    rate_per_s: float = 2.0
    long_fraction: float = 0.3
    """Share of requests that are long and start with the shared system prompt."""
    short_prompt: int = 256
    short_output: int = 64
    long_prompt: int = 2048
    shared_prefix: int = 1536
    long_output: int = 128

    def __post_init__(self) -> None:
        check_float("rate_per_s", self.rate_per_s, 0.0, 1e4)
        check_float("long_fraction", self.long_fraction, 0.0, 1.0)

    @classmethod
    def for_context(cls, context: int, rate_per_s: float = 2.0) -> TrafficMix:
        """Shapes that fit the model: short chats at 1/32 of the context, long requests at
        1/4 with three quarters of them a shared system prompt (capped at the reference
        long-context workload's 8K prompt with a 6K shared prefix, docs/architecture.md)."""
        long_prompt = max(min(context // 4, 8192), 64)
        return cls(rate_per_s=rate_per_s,
                   short_prompt=max(min(context // 32, 2048), 16),
                   short_output=max(min(context // 64, 256), 8),
                   long_prompt=long_prompt, shared_prefix=long_prompt * 3 // 4,
                   long_output=max(min(context // 64, 256), 8))


class TrafficGenerator:
    """Submits requests to an engine at Poisson arrival times on the engine clock."""

    @classmethod
    def for_engine(cls, engine: Engine, rate_per_s: float | None = None,
                   seed: int | None = None) -> TrafficGenerator:
        """Traffic sized to the engine: a simulated card gets the context-scaled mix at 3
        requests/s; a real model on a laptop CPU gets short requests at 0.5/s, so each one
        can be watched."""
        ex = engine.executor
        if ex.info.virtual_time:
            mix = TrafficMix.for_context(min(engine.max_model_len, 32768),
                                         3.0 if rate_per_s is None else rate_per_s)
        else:
            mix = TrafficMix(rate_per_s=0.5 if rate_per_s is None else rate_per_s,
                             short_prompt=48, short_output=24, long_prompt=192,
                             shared_prefix=160, long_output=24)
        return cls(engine, mix, ex.info.vocab_size,
                   seed=engine.config.seed if seed is None else seed)

    def __init__(self, engine: Engine, mix: TrafficMix, vocab_size: int, seed: int = 0):
        self.engine = engine
        self.mix = mix
        self.vocab = vocab_size
        self.rng = random.Random(seed)
        self.prefix = [self.rng.randrange(3, vocab_size) for _ in range(mix.shared_prefix)]
        self.next_arrival: float | None = None
        self.count = 0
        self.refused = 0
        """Arrivals the engine refused (a full queue); the console shows the count."""
        self._lock = threading.Lock()

    def set_rate(self, rate_per_s: float) -> None:
        """Change the arrival rate (validated; thread-safe)."""
        mix = replace(self.mix, rate_per_s=rate_per_s)
        with self._lock:
            self.mix = mix
            self.next_arrival = None  # redraw the gap at the new rate

    def set_long_fraction(self, fraction: float) -> None:
        mix = replace(self.mix, long_fraction=fraction)
        with self._lock:
            self.mix = mix

    def _gap(self) -> float:
        return self.rng.expovariate(self.mix.rate_per_s)

    def __call__(self, engine: Engine) -> None:
        """Submit every arrival due by now (called on the engine thread)."""
        with self._lock:
            mix = self.mix
            if mix.rate_per_s <= 0:
                self.next_arrival = None
                return
            now = engine.clock.now()
            if self.next_arrival is None:
                self.next_arrival = now + self._gap()
            while self.next_arrival <= now:
                self._submit(mix, self.next_arrival)
                self.next_arrival += self._gap()
            if not engine.has_work:
                # An idle engine on a virtual clock jumps to its next arrival: give it one.
                self._submit(mix, self.next_arrival)
                self.next_arrival += self._gap()

    def _submit(self, mix: TrafficMix, at: float) -> None:
        long = self.rng.random() < mix.long_fraction
        if long:
            tail = [self.rng.randrange(3, self.vocab)
                    for _ in range(mix.long_prompt - mix.shared_prefix)]
            prompt, out = self.prefix + tail, mix.long_output
        else:
            prompt = [self.rng.randrange(3, self.vocab) for _ in range(mix.short_prompt)]
            out = mix.short_output
        self.count += 1
        try:
            self.engine.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                                    request_id=f"{'long' if long else 'chat'}-{self.count}",
                                    arrival_time=at)
        except KvdeckError:  # queue full: counted and shown, never silent
            self.refused += 1
