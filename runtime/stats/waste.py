"""Computed against useful tokens, and why the difference was computed: a token is wasted
when a step computes a position a request had already computed (its KV was thrown away by a
preemption that recomputes, a KV-format switch, or an executor that lost it) or scores a
draft position verification rejects. Read from step records only, so the live engine and
its replay count the same (docs/architecture.md, "Waste")."""

from __future__ import annotations

from dataclasses import dataclass

CAUSES = ("preemption", "format switch", "offload switch", "lost KV", "rejected drafts",
          "padding")
"""Why a computed token was wasted. A switch's cause: it re-laid the pool smaller and
preempted requests to fit, or emptied the host tier under swapped ones. `lost KV`:
recomputed with no recorded cause (an executor that recycled the KV's memory)."""


@dataclass(frozen=True)
class WasteView:
    """Tokens computed, those wasted by cause, and the rest (useful)."""

    computed: int
    wasted: dict[str, int]

    @property
    def useful(self) -> int:
        return self.computed - sum(self.wasted.values())


class Waste:
    """Counts a run's computed and wasted tokens from its step records (`on_record`)."""

    def __init__(self):
        self.computed = 0
        self.wasted = dict.fromkeys(CAUSES, 0)
        self._high: dict[str, int] = {}
        """Per request: positions whose KV it has computed at some point."""
        self._cause: dict[str, str] = {}
        """Per request that lost its KV: why (until it has recomputed it)."""

    def on_record(self, record, num_tokens: int) -> None:
        """One step's record (`StepRecord`) and the tokens its plan computed (the figures
        have the sum): its preemptions and switches say why KV went, its plan what was
        computed again."""
        swapped = set(record.swapped)
        for rid in record.preempted:
            if rid not in swapped:  # swapped out: its KV comes back, nothing recomputed
                self._cause[rid] = "preemption"
        for sw in record.switches:  # their preemptions are the switch's own, not the plan's
            cause = "offload switch" if sw.knob == "offload_layers" else "format switch"
            for rid in (*sw.preempted, *sw.unswapped):
                self._cause[rid] = cause
        # Every request, every step: one lookup and one store for the common decode row.
        high, causes, wasted = self._high, self._cause, self.wasted
        for rid, start, n, sampled, draft in record.plan:
            end = start + n
            h = high.get(rid, 0)
            if start < h:  # computed before: again (up to where it had got)
                wasted[causes.get(rid, "lost KV")] += min(end, h) - start
            if draft:  # positions past the emitted ones hold rejected drafts' KV
                rejected = max(n - max(sampled, 1), 0)
                wasted["rejected drafts"] += rejected
                end -= rejected
            if end >= h:
                high[rid] = end
                if causes:
                    causes.pop(rid, None)
        self.computed += num_tokens
        # Rows run to fill an execution shape: computed, and useful to nobody.
        self.computed += record.padding
        self.wasted["padding"] += record.padding
        for f in record.finished:
            self._high.pop(f.request_id, None)
            self._cause.pop(f.request_id, None)

    def view(self) -> WasteView:
        return WasteView(self.computed, dict(self.wasted))

    def to_json(self) -> dict:
        # Copies: a replay keeps checkpoints in memory while this goes on counting.
        return {"computed": self.computed, "wasted": dict(self.wasted),
                "high": dict(self._high), "cause": dict(self._cause)}

    def load(self, d: dict) -> None:
        """Continue from a checkpoint's counts (runs recorded before them start at 0)."""
        self.computed = d["computed"]
        self.wasted.update(d["wasted"])
        self._high, self._cause = dict(d["high"]), dict(d["cause"])
