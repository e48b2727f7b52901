"""The source chapters' worked examples as scenarios kvdeck runs (`kvdeck scenario`).

A scenario is a TOML file under `profiles/scenarios/` (a user's own first, as profiles are):
its setup — which profiles, budgets and schemes the example takes — and, in `[chapter]`,
the figures the chapter states, with the relative tolerance they are held to. Figures a
profile's own measurements were taken from (the reference card's decode steps, its prefill
efficiency, the draft's tokens per round) go in `[calibration]` instead: kvdeck reproduces
them, which shows the profile is read right, not that the model predicts. Running it
computes kvdeck's own figures through the real planner, step model, KV arithmetic and sim
executor (`scenario_kinds.KINDS`); the chapter's figures are never an input to that
computation, only what it is set beside. A scenario whose chapter is inconsistent says so,
with the arithmetic, in its `note`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.profiles import _load, _number, available_profiles
from kvdeck.runtime.planning.scenario_kinds import KINDS


@dataclass(frozen=True)
class Figure:
    """One figure of a scenario: the chapter's and kvdeck's."""

    name: str
    chapter: float | str
    kvdeck: float | str
    tolerance: float
    """Relative; figures that are words (a chosen scheme) must be equal."""
    calibration: bool = False
    """A figure a profile was calibrated on: reproduced, not predicted."""
    inconsistent: bool = False
    """A figure the chapter states wrongly (its scenario's note gives the arithmetic):
    kvdeck's is expected to differ."""

    @property
    def holds(self) -> bool:
        if isinstance(self.chapter, str) or isinstance(self.kvdeck, str):
            return self.chapter == self.kvdeck
        if math.isinf(self.chapter) or math.isinf(self.kvdeck):
            return self.chapter == self.kvdeck
        return abs(self.kvdeck - self.chapter) <= self.tolerance * abs(self.chapter)


@dataclass(frozen=True)
class Scenario:
    """A worked example: its source, setup and the chapter's figures."""

    name: str
    title: str
    source: str
    """Chapter and section, e.g. `000 §8.7, comprehensive example`."""
    kind: str
    setup: dict[str, Any]
    chapter: dict[str, float | str]
    tolerance: float
    note: str = ""
    tolerances: dict[str, float] = field(default_factory=dict)
    """Per-figure tolerances where one figure is held looser, with the reason in `note`."""
    calibration: dict[str, float | str] = field(default_factory=dict)
    """The chapter's figures a profile's measurements came from (see the module docstring)."""
    inconsistent: dict[str, float | str] = field(default_factory=dict)
    """Figures the chapter states inconsistently with its own facts (see `note`)."""

    @classmethod
    def load(cls, name: str) -> Scenario:
        d, where = _load("scenarios", name)
        kind = d.get("kind")
        if kind not in KINDS:
            raise ConfigError(f"Scenario {where}: kind must be one of {', '.join(KINDS)}, got "
                              f"{kind!r}.")
        chapter, calibration = d.get("chapter"), d.get("calibration", {})
        inconsistent = d.get("inconsistent", {})
        if not isinstance(chapter, dict) or not chapter or not isinstance(calibration, dict) \
                or not isinstance(inconsistent, dict):
            raise ConfigError(f"Scenario {where}: [chapter] must give the chapter's figures "
                              "(and [calibration], if there, a table of them too).")
        tolerances = d.get("tolerances", {})
        tolerance = _number(d, "tolerance", where, default=0.01, positive=False, most=1.0)
        return cls(name, str(d.get("title", name)), str(d.get("source", "")), kind,
                   dict(d.get("setup", {})), chapter, tolerance, str(d.get("note", "")),
                   {k: _number(tolerances, k, where, positive=False, most=1.0, table="tolerances")
                    for k in tolerances}, calibration, inconsistent)

    def run(self) -> list[Figure]:
        """kvdeck's figures beside the chapter's, in the chapter's order; a figure kvdeck
        did not compute is an error in the scenario."""
        ours = KINDS[self.kind](self.setup)
        missing = [k for k in (*self.chapter, *self.calibration, *self.inconsistent)
                   if k not in ours]
        if missing:
            raise ConfigError(f"Scenario {self.name}: kvdeck computes no {', '.join(missing)} "
                              f"for a {self.kind} scenario; it computes {', '.join(ours)}.")
        return [Figure(k, v, ours[k], self.tolerances.get(k, self.tolerance),
                       k in self.calibration, k in self.inconsistent)
                for k, v in (*self.chapter.items(), *self.calibration.items(),
                             *self.inconsistent.items())]


def scenario_names() -> list[str]:
    return available_profiles("scenarios")
