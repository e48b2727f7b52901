"""Routers of the simulated fleet, as models of the ones the field runs (`base.Router` is
the interface; `make_router` reads a name like `weighted:prefix=3,queue=2`)."""

from __future__ import annotations

from kvdeck.runtime.cluster.routers.base import Router
from kvdeck.runtime.cluster.routers.prefix import Cost, PrefixAware, Weighted
from kvdeck.runtime.cluster.routers.simple import LeastLoaded, Random, RoundRobin
from kvdeck.runtime.errors import ConfigError

ROUTERS: dict[str, type[Router]] = {cls.name: cls for cls in (
    RoundRobin, Random, LeastLoaded, PrefixAware, Weighted, Cost)}
"""Router classes by name."""


def make_router(text: str, seed: int = 0) -> Router:
    """A router from `name` or `name:key=value,...`; one sentence naming what is wrong."""
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


__all__ = ["ROUTERS", "Router", "make_router"]
