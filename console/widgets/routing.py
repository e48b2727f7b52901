"""Routing panel (`kvdeck serve --cascade SMALL,LARGE --console`): the cascade's escalation
rate, its confidence histogram with the threshold marked, per route the requests, good
answers, goodput, accelerator seconds per good answer and mean latency, and what it saved
against sending everything to the large model (`runtime/server/cascade.py`)."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from kvdeck.runtime.server.cascade import CONFIDENCE_BINS, CascadeView

SPARK = " ▁▂▃▄▅▆▇█"
ROUTE_NAMES = {"small": "small", "escalated-confidence": "unsure → large",
               "escalated-check": "check → large"}


class RoutingPanel(Static):
    DEFAULT_CSS = "RoutingPanel { height: auto; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "Routing"

    def show(self, view: CascadeView) -> None:
        c = view.config
        self.border_subtitle = f"{c.name}: {c.small} → {c.large}"
        head = Text(f"{view.requests:,} requests · escalated {view.escalation_rate:.0%}",
                    style="bold")
        rule = Text(f"escalate when {c.measure} < {c.threshold:g}", style="dim")
        if not view.requests:
            self.update(Group(head, rule, Text(f"Ask for model '{c.name}' to use it.",
                                               style="dim")))
            return
        self.update(Group(head, rule, histogram(view), *routes_lines(view), savings(view)))


def histogram(view: CascadeView) -> Text:
    """One bar per tenth of confidence, 0 → 1, with `|` where the threshold falls."""
    peak = max(view.confidence_counts) or 1
    text = Text("confidence 0 ")
    mark = min(int(view.config.threshold * len(CONFIDENCE_BINS)), len(CONFIDENCE_BINS))
    for i, n in enumerate(view.confidence_counts):
        if i == mark:
            text.append("|", style="bold red")
        style = "yellow" if i < mark else "green"
        text.append(SPARK[round(n / peak * (len(SPARK) - 1))] if n else "·", style=style)
    if mark == len(CONFIDENCE_BINS):
        text.append("|", style="bold red")
    text.append(" 1")
    return text


def routes_lines(view: CascadeView) -> list[Text]:
    """Two lines per route taken: requests and good answers; then goodput, accelerator
    seconds per good answer and mean latency (narrow enough for the right column)."""
    lines = []
    for key, r in view.routes.items():
        if not r.requests:
            continue
        goodput = r.good / view.elapsed_s if view.elapsed_s > 0 else 0.0
        per_good = f"{r.accelerator_s / r.good:.2f} s/good" if r.good else "no good answer"
        lines.append(Text.assemble((ROUTE_NAMES[key], "bold"),
                                   f" {r.requests:,} req · {r.good:,} good"))
        lines.append(Text(f"  {goodput:.2f} good/s · {per_good} · "
                          f"{r.latency_s / r.requests:.2f} s", style="dim"))
    return lines


def savings(view: CascadeView) -> Text:
    if view.saved is None:
        return Text("saved vs all-large: after the first escalation (its cost ratio)",
                    style="dim")
    accel, latency = view.saved
    return Text(f"saved vs all-large: {accel:,.1f} accel s, {latency:,.1f} s latency "
                "(the large/small ratio measured on escalated requests)", style="dim")
