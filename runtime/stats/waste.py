"""Computed against useful tokens, and why the difference was computed: a token is wasted
when a step computes a position a request had already computed (its KV was thrown away by a
preemption that recomputes, a KV-format or offload switch, or a failed step that lost its
host copy) or scores a draft position verification rejects. Read from step records only, so
the live engine and its replay count the same (docs/architecture.md, "Waste").

A record names the requests whose KV went and how far each had got (`StepRecord.dropped`),
so the count looks at a step's rows only while such a request is recomputing, or when the
step verified drafts: a plain decode step costs it nothing per row."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import itemgetter

CAUSES = ("preemption", "format switch", "offload switch", "lost KV", "rejected drafts",
          "padding")
"""Why a computed token was wasted. A switch's cause: it re-laid the pool smaller and
preempted requests to fit, or emptied the host tier under swapped ones. `lost KV`: a step
that copied KV out to the host failed, so no host copy is trusted and the swapped requests
recompute."""

_draft = itemgetter(4)
"""A plan entry's draft length (`PlanEntry.draft`)."""


@dataclass(frozen=True)
class WasteView:
    """Tokens computed, those wasted by cause, and the rest (useful)."""

    computed: int
    wasted: dict[str, int]

    @property
    def useful(self) -> int:
        return self.computed - sum(self.wasted.values())


class Waste:
    """Counts a run's computed and wasted tokens from its step records (`on_record` for a
    step that ran, `on_idle` for one that did not)."""

    def __init__(self):
        self.computed = 0
        self.wasted = dict.fromkeys(CAUSES, 0)
        self._pending: dict[str, tuple[int, str]] = {}
        """Per request whose KV went: the positions it had computed and why they went,
        until it has computed them again."""

    def on_idle(self, record) -> None:
        """A record whose step ran nothing: its switches may still have dropped KV."""
        if record.dropped:
            self._drops(record)

    def on_record(self, record, num_tokens: int) -> None:
        """One step's record (`StepRecord`) and the tokens its plan computed (the figures
        have the sum): what KV went and why, and what the plan computed again."""
        if record.dropped:
            self._drops(record)
        plan, wasted = record.plan, self.wasted
        if self._pending:
            self._recomputed(plan)
        # C-level filter: a step without drafts is not walked row by row.
        for _, _, n, sampled, _d in compress(plan, map(_draft, plan)):
            wasted["rejected drafts"] += max(n - max(sampled, 1), 0)
        self.computed += num_tokens
        # Rows run to fill an execution shape: computed, and useful to nobody.
        self.computed += record.padding
        wasted["padding"] += record.padding
        if self._pending:
            for f in record.finished:
                self._pending.pop(f.request_id, None)

    def _drops(self, record) -> None:
        """Why each dropped request's KV went: the plan preempted it, a switch did (a
        switch's preemptions are its own, not in the record's `preempted`), or a failed
        step lost its host copy."""
        causes = dict.fromkeys(record.dropped, "lost KV")
        swapped = set(record.swapped)
        for rid in record.preempted:
            if rid not in swapped:  # swapped out: its KV comes back, nothing recomputed
                causes[rid] = "preemption"
        for sw in record.switches:
            cause = "offload switch" if sw.knob == "offload_layers" else "format switch"
            for rid in (*sw.preempted, *sw.unswapped):
                causes[rid] = cause
        pending = self._pending
        for rid, had in record.dropped.items():
            before = pending.get(rid, (0, ""))[0]
            pending[rid] = (max(had, before), causes[rid])

    def _recomputed(self, plan) -> None:
        """Rows of requests recomputing what they had: wasted up to where they had got."""
        pending, wasted = self._pending, self.wasted
        for rid, start, n, sampled, draft in plan:
            p = pending.get(rid)
            if p is None:
                continue
            had, cause = p
            end = start + n
            if start < had:
                wasted[cause] += min(end, had) - start
            if draft:  # positions past the emitted ones hold rejected drafts' KV
                end -= max(n - max(sampled, 1), 0)
            if end >= had:
                del pending[rid]

    def view(self) -> WasteView:
        return WasteView(self.computed, dict(self.wasted))

    def to_json(self) -> dict:
        # Copies: a replay keeps checkpoints in memory while this goes on counting.
        return {"computed": self.computed, "wasted": dict(self.wasted),
                "pending": {rid: list(p) for rid, p in self._pending.items()}}

    def load(self, d: dict) -> None:
        """Continue from a checkpoint's counts (runs recorded before them start at 0)."""
        self.computed = d["computed"]
        self.wasted.update(d["wasted"])
        self._pending = {rid: (had, cause) for rid, (had, cause)
                         in d.get("pending", {}).items()}
        for rid, cause in d.get("cause", {}).items():  # checkpoints before `pending`
            self._pending[rid] = (d["high"].get(rid, 0), cause)
