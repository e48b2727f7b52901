"""The router interface, and reading a router's name and settings.

A router picks the replica for each arriving request from `ReplicaView`s — what a real
router knows: KV events and metrics, published late, and its own requests in flight
(`runtime/cluster/view.py`). Names take settings after a colon, comma-separated:
`weighted:prefix=3,kv=2,queue=2`, `cost:overlap=1,temperature=0.5` (`make_router`, in the
package's `__init__`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvdeck.runtime.cluster.view import Prompt, ReplicaView


class Router(ABC):
    """Chooses a replica for a request."""

    name: str = ""
    settings: dict[str, float] = {}
    """Its settings and their defaults (what the name may carry after a colon)."""

    def __init__(self, seed: int = 0, **settings: float):
        self.seed = seed
        self.values = {**self.settings, **settings}

    @abstractmethod
    def choose(self, prompt: Prompt, views: list[ReplicaView], now: float) -> ReplicaView:
        """The replica for `prompt`, among `views` (all up, at least one)."""

    def describe(self) -> str:
        extra = ",".join(f"{k}={v:g}" for k, v in self.values.items())
        return f"{self.name}:{extra}" if extra else self.name


def least_loaded(views: list[ReplicaView]) -> ReplicaView:
    """Fewest requests waiting or running (its own sent ones counted), then the least KV
    used, then the first."""
    return min(views, key=lambda v: (v.queue, v.metrics.kv_usage))
