"""Transfers panel: what crosses the device↔host link (out: device → host, in: back), live —
the link's measured speed, the host KV tier (swapped requests, demoted prefix blocks), swaps,
demotions and host hits, the latest step's copies against their lower bound
`bytes / bandwidth`, weight offload and a history of bytes moved per step."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvdeck.console.model_report import human_bytes
from kvdeck.console.widgets.base import SnapshotPanel
from kvdeck.runtime.kv.transfers import Transfer, TransfersView
from kvdeck.runtime.views.snapshot import EngineSnapshot

BARS = " ▁▂▃▄▅▆▇█"
KIND_STYLE = {"swap": "red", "demote": "yellow", "promote": "green", "weights": "cyan",
              "lora": "magenta", "lora unload": "dim magenta"}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds < 0.1 else f"{seconds:,.2f} s"


def group_text(kind: str, direction: str, items: list[Transfer]) -> list[Text]:
    """One step's copies of one kind and direction: count, bytes, time against the bound,
    and how long the step waited for them (less than the time when prefetch overlapped)."""
    arrow = "→host" if direction == "d2h" else "→dev"
    nbytes = sum(t.bytes for t in items)
    seconds = sum(t.seconds for t in items)
    bound = sum(t.bound for t in items)
    stall = sum(t.stall for t in items)
    blocks = sum(t.blocks for t in items)
    what = f"{blocks} blk" if blocks else f"×{len(items)}"
    head = Text(f" {kind}{arrow} {what} {human_bytes(nbytes)}",
                style=KIND_STYLE.get(kind, ""))
    out = [head, Text(f"  {ms(seconds)} (bound {ms(bound)})", style="dim")]
    if stall < seconds * 0.999:
        out.append(Text(f"  compute waited {ms(stall)}", style="dim"))
    return out


def history(view: TransfersView, width: int) -> Text:
    """Bytes moved per step over the recent steps that moved anything."""
    steps = view.recent[-width:]
    if not steps:
        return Text()
    peak = max(s.d2h_bytes + s.h2d_bytes for s in steps) or 1
    text = Text("")
    for s in steps:
        total = s.d2h_bytes + s.h2d_bytes
        text.append(BARS[max(1, round(total / peak * (len(BARS) - 1)))], style="cyan")
    text.append(f" max {human_bytes(peak)}", style="dim")
    return text


class TransfersPanel(SnapshotPanel):
    DEFAULT_CSS = "TransfersPanel { height: auto; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "Transfers"

    def draw(self, snap: EngineSnapshot) -> None:
        view = snap.transfers
        if view is None:
            self.update(Text("No transfer figures in this snapshot.", style="dim"))
            return
        width = max(self.size.width - 4, 16)
        c = view.counters
        k = snap.knobs
        self.border_subtitle = ""
        if not view.host_blocks and not view.offload:
            self.update(Group(
                Text(f"link {view.link_detail}", style="dim"),
                Text("No host KV tier (--host-kv-memory-gib) and no weight offload "
                     "(--offload-layers): nothing moves.", style="dim")))
            return
        lines: list[Text] = []
        if view.host_blocks:
            used = view.host_swapped + view.host_demoted
            lines.append(Text(f"host {used:,}/{view.host_blocks:,} blk "
                              f"{human_bytes(view.host_bytes)}", style="bold"))
            lines.append(Text(f" ▓ {view.host_swapped:,} swapped ░ {view.host_demoted:,} "
                              "demoted"))
            lines.append(Text(f"swaps {c['swap_outs']:,} out {c['swap_ins']:,} in",
                              style="red" if view.swapped_requests else ""))
            if view.swapped_requests:
                names = ", ".join(view.swapped_requests[:3])
                more = len(view.swapped_requests) - 3
                lines.append(Text(f" on host: {names}{f' +{more}' if more > 0 else ''}",
                                  style="red"))
            lines.append(Text(f"mode: {k.preemption}, demotion "
                              f"{'on' if k.demote_prefixes else 'off'}", style="dim"))
            lines.append(Text(f"prefix {c['demotions']:,} demoted", style="yellow"))
            lines.append(Text(f" {c['promotions']:,} host hits "
                              f"({c['host_hit_tokens']:,} tok)", style="yellow"))
        if view.offload:
            first, *rest = view.offload.split("; ")
            lines.append(Text(f"offload {first}", style="cyan"))
            lines.extend(Text(f" {part}", style="cyan") for part in rest)
            lines.append(Text(f" +{human_bytes(view.offload_gain_bytes)} for KV", style="cyan"))
        last = view.last
        if last is not None:
            lines.append(Text(f"step {last.step}: out {human_bytes(last.d2h_bytes)} "
                              f"in {human_bytes(last.h2d_bytes)}", style="bold"))
            groups: dict[tuple[str, str], list[Transfer]] = {}
            for t in last.transfers:
                groups.setdefault((t.kind, t.direction), []).append(t)
            for (kind, direction), items in groups.items():
                lines.extend(group_text(kind, direction, items))
            lines.append(history(view, width - 13))
        lines.append(Text(f"KV out {human_bytes(c['d2h_bytes'])} "
                          f"in {human_bytes(c['h2d_bytes'])}", style="dim"))
        if c["weight_bytes"]:
            lines.append(Text(f"weights in {human_bytes(c['weight_bytes'])}", style="dim"))
        lines.append(Text(f"link {view.link_detail}", style="dim"))
        self.update(Group(*lines))
