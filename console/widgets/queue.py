"""Queue panel: the last iteration's batch against its budgets, then running and waiting
requests with their progress, wait, deadline slack and priority."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdeck.console.widgets.base import SnapshotPanel
from kvdeck.runtime.views.snapshot import EngineSnapshot, RequestView


def budget_bar(decode: int, prefill: int, budget: int, width: int = 24) -> Text:
    """Decode tokens, prefill tokens and unused budget as one bar."""
    budget = max(budget, 1)
    d = round(width * decode / budget)
    p = min(round(width * prefill / budget), width - d)
    bar = Text()
    bar.append("█" * d, style="bold cyan")
    bar.append("█" * p, style="bold magenta")
    bar.append("·" * (width - d - p), style="dim")
    return bar


def compact(n: int) -> str:
    """A token count in at most 5 characters."""
    return f"{n / 1000:.1f}k" if 1000 <= n < 100_000 else f"{n // 1000}k" if n >= 100_000 \
        else str(n)


class QueuePanel(SnapshotPanel):
    """Waiting / running / preempted requests and the batch composition."""

    DEFAULT_CSS = "QueuePanel { height: 1fr; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "Queue"

    def draw(self, snap: EngineSnapshot) -> None:
        b = snap.batch
        narrow = self.size.width < 50  # 80 columns: the essentials only
        head = Text()
        if b is not None:
            head.append(f"step {b.step} ")
            head.append_text(budget_bar(b.num_decode_tokens, b.num_prefill_tokens,
                                        b.token_budget, width=6 if narrow else 12))
            if narrow:
                head.append(f" {b.seconds * 1e3:.0f} ms\n{b.num_decode_tokens}+"
                            f"{b.num_prefill_tokens}/{b.token_budget} tok · {b.num_seqs} seqs")
            else:
                head.append(f" {b.num_decode_tokens}+{b.num_prefill_tokens}/{b.token_budget} "
                            f"tok ({b.unused_budget} unused) {b.num_seqs}/{b.max_num_seqs} "
                            f"seqs {b.seconds * 1e3:.1f} ms")
            if b.padding:  # an execution shape: the graph the rows ran in
                rows = b.num_decode_tokens + b.num_prefill_tokens
                head.append(f"\n{rows} → {rows + b.padding}-row graph (+{b.padding})" if narrow
                            else f"\n{rows} rows → {rows + b.padding}-row graph "
                            f"({b.padding} padding)", style="dim")
            if b.itl_target_s:
                # The ITL target's step: what it allowed, what the model predicted, what ran.
                head.append(f"\nITL target {b.itl_target_s * 1e3:.0f} ms · predicted "
                            f"{(b.predicted_s or 0) * 1e3:.1f} · measured "
                            f"{b.seconds * 1e3:.1f} ms",
                            style="red" if b.seconds > b.itl_target_s * 1.05 else "")
            r = snap.roofline
            if r is not None:  # the step against the machine's roofline
                style = {"overhead": "yellow", "memory": "cyan", "compute": "magenta"}[r.bound]
                mbu, mfu = r.utilisation()
                if narrow:  # one line of 24 columns
                    head.append(f"\n{r.bytes_read / 1e9:.1f} GB MBU {100 * mbu:.0f}% ")
                    head.append(r.bound, style=style)
                else:
                    head.append(f"\nread {r.bytes_read / 1e9:.2f} GB · floor "
                                f"{r.floor_s * 1e3:.1f} ms · MBU {100 * mbu:.0f}% · MFU "
                                f"{100 * mfu:.0f}% · gap {r.gap_s * 1e3:.1f} ms · ")
                    head.append(f"{r.bound}-bound", style=style)
            elif not narrow and b.seconds:
                head.append("\nroofline: this machine's peaks are not measured yet "
                            "(kvdeck calibrate)", style="dim")
        else:
            head.append("no iteration yet")
        if b is not None and b.limit and snap.waiting:
            head.append(f"\n{len(snap.waiting)} waiting: {b.limit}", style="yellow")
        adapters = by_adapter(snap)
        if adapters:  # LoRA rows share the batch: how many run with each adapter
            head.append(f"\nadapters {adapters}", style="dim")
        table = Table(box=None, expand=True, pad_edge=False, show_edge=False,
                      padding=(0, 1, 0, 0) if narrow else (0, 1))
        columns = (("id", "left"), ("state", "left"), ("prompt", "right"), ("out", "right"),
                   ("wait s", "right"), ("slack s", "right"), ("prio", "right"))
        for col, just in columns[:4] if narrow else columns:
            table.add_column(col, justify=just, no_wrap=True)
        rows = max(self.size.height - 4 - head.plain.count("\n"), 3)
        views = list(snap.running) + list(snap.waiting)
        for v in views[:rows]:
            table.add_row(*(self._short_row(v) if narrow else self._row(v, snap.time)))
        more = len(views) - rows
        foot = Text(f"{len(snap.running)} running, {len(snap.waiting)} waiting"
                    + (f" (+{more} not shown: l lists them all)" if more > 0 else ""),
                    style="dim")
        self.border_subtitle = f"{snap.num_finished} done · {snap.num_rejected} rejected · " \
                               f"{snap.num_preemptions} preemptions"
        self.update(Group(head, table, foot))

    @staticmethod
    def _short_row(v: RequestView) -> tuple[str, ...]:
        """id, state, prompt progress (a share until computed, then its size), tokens out."""
        state = {"running": "[green]run[/]", "waiting": "[yellow]wait[/]",
                 "preempted": "[red]pre[/]", "swapped": "[magenta]swap[/]"
                 }.get(v.status, v.status[:4])
        done = min(v.computed_tokens, v.prompt_tokens)
        progress = compact(v.prompt_tokens) if done >= v.prompt_tokens else \
            f"{done / max(v.prompt_tokens, 1):.0%}"
        return v.request_id[-8:], state, progress, str(v.output_tokens)

    @staticmethod
    def _row(v: RequestView, now: float) -> tuple[str, ...]:
        state = {"running": "[green]run[/]", "waiting": "[yellow]wait[/]",
                 "preempted": "[red]preempt[/]", "swapped": "[magenta]swapped[/]"
                 }.get(v.status, v.status)
        progress = f"{min(v.computed_tokens, v.prompt_tokens)}/{v.prompt_tokens}"
        waited = (v.admitted_time if v.admitted_time is not None else now) - v.arrival_time
        slack = f"{v.deadline - now:.1f}" if v.deadline is not None else "—"
        return (v.request_id[-12:], state, progress, f"{v.output_tokens}/{v.max_tokens}",
                f"{waited:.1f}", slack, str(v.priority))


def by_adapter(snap: EngineSnapshot) -> str:
    """'base 3 run · a 2 run, 1 wait · ...' when any request runs with a LoRA adapter; ''
    otherwise."""
    views = list(snap.running) + list(snap.waiting)
    if not any(v.lora for v in views):
        return ""
    counts: dict[str, list[int]] = {}
    for v in views:
        c = counts.setdefault(v.lora or "base", [0, 0])
        c[v.status != "running"] += 1
    return " · ".join(f"{name} {run} run" + (f", {wait} wait" if wait else "")
                      for name, (run, wait) in sorted(counts.items()))
