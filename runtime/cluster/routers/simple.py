"""Routers that know only load: round-robin, random, least-loaded (what vLLM's production
stack and llm-d's load-aware profile do)."""

from __future__ import annotations

import random

from kvdeck.runtime.cluster.routers.base import Router, least_loaded
from kvdeck.runtime.cluster.view import Prompt, ReplicaView


class RoundRobin(Router):
    """Each replica in turn."""

    name = "round-robin"

    def __init__(self, seed: int = 0, **settings: float):
        super().__init__(seed, **settings)
        self._next = 0

    def choose(self, prompt: Prompt, views: list[ReplicaView], now: float) -> ReplicaView:
        view = views[self._next % len(views)]
        self._next += 1
        return view


class Random(Router):
    """A replica drawn uniformly (seeded, so runs repeat)."""

    name = "random"

    def __init__(self, seed: int = 0, **settings: float):
        super().__init__(seed, **settings)
        self._rng = random.Random(seed)

    def choose(self, prompt: Prompt, views: list[ReplicaView], now: float) -> ReplicaView:
        return views[self._rng.randrange(len(views))]


class LeastLoaded(Router):
    """Fewest requests waiting or running, then the least KV in use."""

    name = "least-loaded"

    def choose(self, prompt: Prompt, views: list[ReplicaView], now: float) -> ReplicaView:
        return least_loaded(views)
