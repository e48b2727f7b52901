"""A model profile's measured tables, `[<name>.<hardware>] points = [...]`, read and checked
the one way (`[prefill.…]`, `[wake.…]`, `[slot_save.…]`)."""

from __future__ import annotations

from collections.abc import Callable

from kvdeck.runtime.errors import ConfigError


def number(x: object) -> bool:
    """An int or a float, not a bool (TOML's true is no number of milliseconds)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def whole(x: object) -> bool:
    """An int, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def point_tables(d: dict, where: str, name: str, size: int, good: Callable[[list], bool],
                 what: str) -> dict[str, list[list]]:
    """Profile `where`'s `[name.<hardware>]` tables: each one's `points`, a non-empty list
    of `size`-element lists that each pass `good`, by hardware name; else a ConfigError
    saying they must be a list of `what`."""
    tables = d.get(name, {})
    if not isinstance(tables, dict):
        raise ConfigError(f"Profile {where}: {name} must be a table of [{name}.<hardware>] "
                          f"tables, got {tables!r}.")
    out = {}
    for hw, table in tables.items():
        points = table.get("points") if isinstance(table, dict) else None
        if not isinstance(points, list) or not points or not all(
                isinstance(p, list) and len(p) == size and good(p) for p in points):
            raise ConfigError(f"Profile {where}: {name}.{hw}.points must be a list of "
                              f"{what}, got {points!r}.")
        out[hw] = points
    return out
