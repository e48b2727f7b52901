"""Fault injection for the crash-containment tests: `KVDECK_FAULT` names points where the
process kills itself with SIGSEGV, exactly as a fault in a native library would end it.

`KVDECK_FAULT` is a comma-separated list of points, each optionally `:N` (die at the Nth
time the point is reached in this process, default the first):

- `repack-decode`: every llama.cpp decode with re-packed weights (extra buffer types on)
  dies; a machine where llama.cpp's AMX kernels crash, as on some Xeons.
- `probe`: every llama.cpp probe child dies, whatever its settings: a machine where
  llama.cpp cannot run at all.
- `decode`: a llama.cpp executor's decode dies (not the probe's), e.g. `decode:3` in its
  third step.

Unset, every check is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "KVDECK_FAULT"
POINTS = ("repack-decode", "probe", "decode")

_reached: Counter[str] = Counter()


def _armed() -> dict[str, int]:
    out: dict[str, int] = {}
    for item in os.environ.get(ENV, "").split(","):
        name, _, count = item.strip().partition(":")
        if name in POINTS:
            out[name] = int(count) if count.isdigit() and int(count) > 0 else 1
    return out


def crash_at(point: str) -> None:
    """Kill this process with SIGSEGV when `KVDECK_FAULT` arms `point` and this is its
    Nth arrival here."""
    armed = _armed()
    if point not in armed:
        return
    _reached[point] += 1
    if _reached[point] >= armed[point]:
        os.kill(os.getpid(), signal.SIGSEGV)


def fault_spec() -> str:
    """The armed faults as set (part of the llama.cpp probe's cache key, so a test's
    simulated machine never answers for the real one)."""
    return os.environ.get(ENV, "")
