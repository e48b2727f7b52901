"""`kvdeck plan` over parallel layouts: the same workload planned on one replica spanning
`tp × pp` cards for each layout that holds the model, with cards as a cost.

Each layout gets its own KV budget (what its cards leave at 90 % of their memory, less the
weights: `Layout.kv_budget_bytes`) and its steps priced by the roofline across its cards
(`parallel.layout_step_seconds`: a share of the weights, KV and FLOPs per card, the
all-reduces per layer over the interconnect, pipeline bubbles). The cheapest layout is the
one whose cheapest feasible scheme costs the fewest card-seconds per good result
(accelerator seconds × cards); the verdict says how many cards that is and why fewer do not
do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.parallel import LAYOUT_SIZES, Layout
from kvdeck.runtime.planning.planner import Planner
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.planning.schemes import Plan

UTILIZATION = 0.9
"""The share of the cards' memory the weights and KV may take (vLLM's default)."""
AUTO = (Layout(1), Layout(2), Layout(4), Layout(8), Layout(4, 2), Layout(8, 2))


@dataclass
class LayoutPlan:
    """One layout's plan, or why the layout cannot hold the model."""

    layout: Layout
    planner: Planner | None
    plan: Plan | None
    budget: float
    problem: str = ""

    @property
    def card_seconds(self) -> float | None:
        """Card-seconds per good result of the layout's choice (None: nothing feasible)."""
        if self.plan is None or self.plan.choice is None:
            return None
        return self.plan.choice.accelerator_s_per_good * self.layout.cards


def parse_layouts(text: str) -> tuple[Layout, ...]:
    """`auto`, or layouts like `TP1,TP2,TP4xPP2`; one sentence naming a wrong one."""
    if text.strip() == "auto":
        return AUTO
    out = []
    for item in filter(None, (x.strip().upper() for x in text.split(","))):
        degrees = {"TP": 1, "PP": 1}
        for part in re.split(r"[X×]", item):
            m = re.fullmatch(r"(TP|PP)(\d+)", part.strip())
            if m is None or int(m[2]) not in LAYOUT_SIZES:
                raise ConfigError(f"--layouts takes auto or layouts like TP1,TP2,TP4xPP2 "
                                  f"(degrees {', '.join(map(str, LAYOUT_SIZES))}); got "
                                  f"{item!r}.")
            degrees[m[1]] = int(m[2])
        out.append(Layout(degrees["TP"], degrees["PP"]))
    if not out:
        raise ConfigError("--layouts names no layout; give auto or e.g. TP1,TP2.")
    return tuple(dict.fromkeys(out))


def fits_one_card(model: ModelProfile, hardware: HardwareProfile) -> bool:
    return hardware.memory_bytes * UTILIZATION > model.weight_bytes


def plan_layouts(make: callable, layouts: tuple[Layout, ...], model: ModelProfile,
                 hardware: HardwareProfile, reserve: int = 0) -> list[LayoutPlan]:
    """Each layout planned: `make(layout, budget)` builds its Planner; `reserve` bytes of
    each layout's memory are kept out of its KV budget (CUDA graphs' replay memory)."""
    out = []
    for layout in layouts:
        try:
            budget = layout.kv_budget_bytes(model, hardware, UTILIZATION, reserve)
        except ConfigError as e:
            out.append(LayoutPlan(layout, None, None, 0.0, str(e)))
            continue
        planner = make(layout, budget)
        out.append(LayoutPlan(layout, planner, planner.plan(), budget))
    return out


def cheapest(plans: list[LayoutPlan]) -> LayoutPlan | None:
    """The layout whose choice costs the fewest card-seconds per good result, fewer cards
    first on a tie."""
    feasible = [p for p in plans if p.card_seconds is not None]
    return min(feasible, key=lambda p: (p.card_seconds, p.layout.cards), default=None)


def verdict(plans: list[LayoutPlan], model: ModelProfile, hardware: HardwareProfile) -> str:
    """One sentence: the cheapest feasible layout, how many cards it needs and why fewer do
    not do; or that none is feasible."""
    best = cheapest(plans)
    if best is None:
        return (f"No layout of {', '.join(p.layout.name for p in plans)} meets the workload "
                f"on {hardware.name}; see each layout's line.")
    fewer = [p for p in plans if p.layout.cards < best.layout.cards]
    held = [p for p in fewer if not p.problem]
    if not fewer:
        why = "the fewest cards tried"
    elif not held:
        why = (f"{model.name}'s {model.weight_bytes / 1e9:,.0f} GB of weights do not fit "
               f"{max(p.layout.cards for p in fewer)} {hardware.name} card(s) at "
               f"{UTILIZATION:.0%} of their memory")
    elif all(p.card_seconds is None for p in held):
        why = "fewer cards hold the model but meet no scheme's limits"
    else:
        why = "it costs fewer card-seconds per good result than fewer cards do"
    return (f"Cheapest feasible layout: {best.layout.name}, {best.layout.cards} "
            f"{hardware.name} card{'s' if best.layout.cards > 1 else ''} "
            f"({best.plan.choice.scheme.name}): {why}.")
