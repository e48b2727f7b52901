"""Locating the data that ships inside the wheel: `profiles/` (TOML) and `themes/` (TCSS).

Both are import packages holding data files, so `importlib.resources` finds them the same
way from an editable install (the repository's folders) and from a built wheel
(site-packages).
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable


def profiles_dir() -> Traversable:
    """The `profiles/` folder: `hardware/`, `models/` and `workloads/` TOML files."""
    return files("profiles")


def themes_dir() -> Traversable:
    """The `themes/` folder: the console's stylesheets and theme definitions."""
    return files("themes")


def profile_names(kind: str) -> list[str]:
    """Names (file stems) of the profiles of one kind: 'hardware', 'models' or 'workloads'."""
    folder = profiles_dir().joinpath(kind)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))
