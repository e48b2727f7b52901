"""Speculation panel: the method and draft length, drafts verified, acceptance overall and
per draft position (a bar each), tokens emitted per verify pass, the mean time per token
over speculation rounds (ΣT/ΣN), and a draft model's name and share of the step time."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from kvdeck.console.widgets.base import SnapshotPanel
from kvdeck.runtime.views.snapshot import EngineSnapshot

BAR = 12


class SpeculationPanel(SnapshotPanel):
    DEFAULT_CSS = "SpeculationPanel { height: auto; border: round $primary; padding: 0 1; }"
    BORDER_TITLE = "Speculation"

    def draw(self, snap: EngineSnapshot) -> None:
        v = snap.speculation
        if v is None or (v.method == "off" and not v.drafts):
            hint = "ngram or draft" if v is not None and v.draft_model else "ngram"
            self.update(Text(f"Speculative decoding is off (knob speculative_method, "
                             f"--speculative-method {hint}).", style="dim"))
            return
        self.border_subtitle = f"{v.method}, k = {v.num_speculative_tokens}"
        lines = [Text(f"{v.drafts:,} drafts · {v.draft_tokens:,} draft tokens"),
                 Text(f"accepted {v.accepted_tokens:,} ({v.acceptance_rate:.0%})", style="bold"),
                 Text(f"{v.mean_accepted_length:.2f} tokens per verify pass")]
        if v.seconds_per_token:
            lines.append(Text(f"{v.seconds_per_token * 1e3:,.2f} ms per token (ΣT/ΣN)",
                              style="dim"))
        if v.draft_model:
            share = v.draft_seconds / v.step_seconds if v.step_seconds else 0.0
            lines.append(Text(f"draft model: {v.draft_model}", style="dim"))
            if v.draft_seconds:
                lines.append(Text(f"drafting: {share:.0%} of step time", style="dim"))
        for i, rate in enumerate(v.per_position):
            filled = round(rate * BAR)
            bar = Text(f"pos {i + 1:>2} ")
            bar.append("█" * filled, style="green")
            bar.append("·" * (BAR - filled), style="dim")
            bar.append(f" {rate:.0%}")
            lines.append(bar)
        if v.method == "off":
            lines.insert(0, Text("off now; figures since start", style="dim"))
        self.update(Group(*lines))
