"""The router interface, and reading a router's name and settings.

A router picks the replica for each arriving request from `ReplicaView`s — what a real
router knows: KV events and metrics, published late, and its own requests in flight
(`runtime/cluster/view.py`). Names take settings after a colon, comma-separated:
`weighted:prefix=3,kv=2,queue=2`, `cost:overlap=1,temperature=0.5`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from kvdeck.runtime.cluster.view import Prompt, ReplicaView
from kvdeck.runtime.errors import ConfigError


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


ROUTERS: dict[str, Callable[..., Router]] = {}
"""Router classes by name (filled by the modules that define them)."""


def register(cls: type[Router]) -> type[Router]:
    ROUTERS[cls.name] = cls
    return cls


def make_router(text: str, seed: int = 0) -> Router:
    """A router from `name` or `name:key=value,...`; one sentence naming what is wrong."""
    from kvdeck.runtime.cluster.routers import prefix, simple  # noqa: F401 - they register

    name, _, rest = text.strip().partition(":")
    cls = ROUTERS.get(name)
    if cls is None:
        raise ConfigError(f"Unknown router {name!r}; the routers are "
                          f"{', '.join(sorted(ROUTERS))}.")
    values: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if key not in cls.settings:
            allowed = ", ".join(cls.settings) or "none"
            raise ConfigError(f"Router {name} has no setting {key!r}; its settings are "
                              f"{allowed}.")
        try:
            number = float(value) if eq else float("nan")
        except ValueError:
            number = float("nan")
        if not number >= 0:
            raise ConfigError(f"Router setting {name}:{key} must be a number of at least 0, "
                              f"like {key}=1; got {item!r}.")
        values[key] = number
    return cls(seed=seed, **values)
