"""Routers of the simulated fleet, as models of the ones the field runs (`base.Router` is
the interface; `make_router` reads a name like `weighted:prefix=3,queue=2`)."""

from kvdeck.runtime.cluster.routers.base import ROUTERS, Router, make_router

__all__ = ["ROUTERS", "Router", "make_router"]
