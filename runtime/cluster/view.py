"""What a router sees of each replica: what a real fleet publishes, late.

A real router (llm-d's, Dynamo's, SGLang's gateway) knows a replica only by its KV events
and its `/metrics`, each some time after the fact, plus the requests it sent itself. So
here every replica publishes after each of its steps — its prefix-cache changes as vLLM's
`BlockStored`/`BlockRemoved` maps (`fleet.block_events`, vLLM's own block hashes) and a
metrics sample (running, waiting, KV usage, tokens waiting to prefill, blocks decoding) —
and the router's view takes each publication in only `staleness_s` after the step that
made it. Requests the router sent since the newest sample it has taken in are counted from
its own books, as a gateway counts its in-flight requests. Routers read `ReplicaView`,
never an engine.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.fleet.block_events import BlockEvents, prompt_block_hashes


@dataclass(frozen=True)
class Sample:
    """One replica's metrics at a time (the figures vLLM's `/metrics` carries)."""

    t: float
    t0: float
    """When the step it follows began: requests sent before then are in it."""
    running: int
    waiting: int
    kv_usage: float
    """Used blocks over the pool (`vllm:kv_cache_usage_perc`)."""
    prefill_tokens: int
    """Prompt tokens admitted or queued and not yet computed."""
    decode_blocks: int
    """Blocks held by requests past their prompt."""


EMPTY = Sample(-math.inf, -math.inf, 0, 0, 0.0, 0, 0)
"""Before any publication: the router knows only what it sent."""


def sample(engine: Engine, t0: float) -> Sample:
    """`engine`'s metrics now, after the iteration that began at `t0` (requests it has
    taken in but whose arrival time has not come count as waiting)."""
    s, kv = engine.scheduler, engine.kv
    held = [r for _, _, r in engine.intake.future] if engine.intake.future else []
    prefill = sum(max(len(r.prompt_token_ids) - max(r.num_computed_tokens,
                                                    r.remote_kv_tokens), 0)
                  for r in (*s.running, *s.waiting, *held))
    decoding = sum(len(kv.tables.get(r.request_id, ())) for r in s.running
                   if r.num_computed_tokens >= len(r.prompt_token_ids))
    return Sample(engine.clock.now(), t0, len(s.running),
                  len(s.waiting) + len(held), kv.num_used_blocks / max(kv.num_blocks, 1),
                  prefill, decoding)


class ReplicaView:
    """One replica as the router knows it (module docstring)."""

    def __init__(self, name: str, block_size: int, staleness_s: float, seed: str):
        self.name = name
        self.block_size = block_size
        self.staleness_s = staleness_s
        self.seed = seed
        self.metrics = EMPTY
        """The newest sample taken in."""
        self.blocks: dict[int, str] = {}
        """Block hash -> medium ("GPU" or "CPU"), from the events taken in."""
        self.sent: deque[tuple[float, int]] = deque()
        """(time sent, prompt tokens) of requests sent after `metrics.t`."""
        self.up = True
        self._pending: deque[tuple[float, Sample, list[dict]]] = deque()

    # -- the replica's side -----------------------------------------------------------------

    def publish(self, metrics: Sample, events: list[dict]) -> None:
        self._pending.append((metrics.t, metrics, events))

    # -- the router's side ------------------------------------------------------------------

    def catch_up(self, now: float) -> None:
        """Take in everything published `staleness_s` or longer before `now`."""
        pending = self._pending
        while pending and pending[0][0] <= now - self.staleness_s:
            _, metrics, events = pending.popleft()
            self.metrics = metrics
            for ev in events:
                kind = ev["type"]
                for h in ev["block_hashes"]:
                    if kind == "BlockStored":
                        self.blocks[h] = ev["medium"]
                    elif self.blocks.get(h) == ev["medium"]:
                        del self.blocks[h]
        # A request sent before the sampled step began was taken in by it (the engine
        # drains its inbox first); one sent while it ran is not in the sample yet.
        while self.sent and self.sent[0][0] <= self.metrics.t0:
            self.sent.popleft()

    def note_sent(self, now: float, prompt_tokens: int) -> None:
        """The router sent a request with `prompt_tokens` left to prefill at `now`."""
        self.sent.append((now, prompt_tokens))

    @property
    def queue(self) -> int:
        """Requests waiting or running, those sent since the last sample included."""
        return self.metrics.running + self.metrics.waiting + len(self.sent)

    @property
    def waiting(self) -> int:
        return self.metrics.waiting + len(self.sent)

    def cached_blocks(self, hashes: list[int]) -> tuple[int, float]:
        """How many of a prompt's block `hashes` this replica holds in a row from the
        start, and their llm-d score (GPU 1.0, CPU 0.8)."""
        n, score = 0, 0.0
        for h in hashes:
            medium = self.blocks.get(h)
            if medium is None:
                break
            n += 1
            score += 1.0 if medium == "GPU" else 0.8
        return n, score


class Prompt:
    """A request as a router sees it: its tokens, and their block hashes computed once and
    only as far as some replica holds them."""

    def __init__(self, tokens: list[int], block_size: int, seed: str,
                 session: str | None = None):
        self.tokens = tokens
        self.session = session
        self.block_size = block_size
        self._hashes = prompt_block_hashes(tokens, block_size, seed)
        self.hashes: list[int] = []

    @property
    def num_blocks(self) -> int:
        return len(self.tokens) // self.block_size

    def hashes_held(self, views: list[ReplicaView]) -> list[int]:
        """The prompt's leading block hashes, as far as any of `views` holds them."""
        while True:
            if self.hashes and not any(self.hashes[-1] in v.blocks for v in views):
                return self.hashes[:-1]
            nxt = next(self._hashes, None)
            if nxt is None:
                return self.hashes
            self.hashes.append(nxt)


class Publisher:
    """Publishes one engine's events and metrics into its view after each step."""

    def __init__(self, engine: Engine, view: ReplicaView):
        self.engine = engine
        self.view = view
        self.events = BlockEvents(engine.kv.block_size, view.seed)
        self.listeners: list = []
        """Also called with (engine time, event maps) for each step that had events."""
        self._last = None

    def after_step(self, t0: float) -> None:
        """After an iteration that began (and took in its inbox) at engine time `t0`."""
        e = self.engine
        record = e.last_record
        events = []
        if record is not None and record is not self._last:
            self._last = record
            events = self.events.translate(record.kv, e.kv.tree)
        metrics = sample(e, t0)
        self.view.publish(metrics, events)
        if events:
            for listener in self.listeners:
                listener(metrics.t, events)
