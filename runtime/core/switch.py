"""A knob switch's record (`core/switches.py` performs them): data only, with its JSON form,
as the step record, checkpoints, snapshots and replay carry it."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

RECENT = 8
"""Switches the snapshots keep (the latest)."""


@dataclass(frozen=True)
class Switch:
    """One switch: what changed, the pause it took, and what it did to the pool."""

    knob: str
    """`kv_format`, `weight_format` or `offload_layers`."""
    old: str
    new: str
    seconds: float
    """The pause (measured on a real executor, modelled on the sim)."""
    measured: bool
    bytes: int
    """KV bytes read and written (a KV format), or weight bytes after (weights, offload)."""
    bytes_before: int = 0
    """Weight bytes before (a weight format or offload switch)."""
    num_blocks: int = 0
    """The pool's blocks after (a KV format or offload switch)."""
    blocks: int = 0
    """Used blocks converted (a re-laid pool)."""
    moved: int = 0
    """Of those, blocks that changed id (a smaller pool)."""
    dropped: int = 0
    """Cached blocks dropped to fit a smaller pool."""
    preempted: tuple[str, ...] = ()
    """Requests preempted to fit a smaller pool (not in the record's `preempted`)."""
    unswapped: tuple[str, ...] = ()
    """Swapped requests whose host copy the emptied host tier lost (they recompute)."""
    offload: str = ""
    """What is offloaded after (an offload switch: `Executor.describe_offload`)."""
    gain: int = 0
    """Device bytes offload frees for the pool after (an offload switch)."""
    step: int | None = None
    """The step it happened before (snapshots and checkpoints; the record knows its own)."""

    def at(self, step: int) -> Switch:
        return replace(self, step=step)

    def to_json(self) -> dict[str, Any]:
        """`{"knob", "from", "to", "seconds", "measured", "bytes", ...}`: the fields that
        are set."""
        d: dict[str, Any] = {"knob": self.knob, "from": self.old, "to": self.new}
        for f in fields(self)[3:]:
            value = getattr(self, f.name)
            if value or f.name in ("seconds", "measured", "bytes") or \
                    (f.name == "step" and value is not None):
                d[f.name] = list(value) if isinstance(value, tuple) else value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Switch:
        known = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()
                  if k in known}
        return cls(old=d["from"], new=d["to"], **values)
