"""Console themes from `themes/themes.toml` (dark, light, high contrast)."""

from __future__ import annotations

from functools import cache

from textual.theme import Theme

from kvdeck.runtime.core.config import tomllib
from kvdeck.runtime.resources import themes_dir


@cache
def load_themes() -> tuple[Theme, ...]:
    data = tomllib.loads(themes_dir().joinpath("themes.toml").read_text(encoding="utf-8"))
    return tuple(Theme(name=f"kvdeck-{name}", **values) for name, values in data.items())
