"""A whole task's time when one of its phases is sped up (Amdahl's law): a request's
prefill and decode are only part of an agent's task, beside tool calls and waiting
(docs/architecture.md, "Whole-task speed-up")."""

from __future__ import annotations


def task_seconds(phases: dict[str, float], speedups: dict[str, float],
                 added_s: float = 0.0) -> float:
    """The task's time with each phase in `speedups` sped up that many times (the others
    unchanged), plus `added_s` of new work (preparing a draft, say)."""
    unknown = set(speedups) - set(phases)
    if unknown:
        raise ValueError(f"no phase {', '.join(sorted(unknown))} in {', '.join(phases)}")
    return sum(t / speedups.get(name, 1.0) for name, t in phases.items()) + added_s


def task_speedup(fraction: float, speedup: float) -> float:
    """`1 / ((1 − f) + f/s)`: the whole task's speed-up when a phase taking `fraction` of
    it runs `speedup` times faster."""
    return 1.0 / ((1.0 - fraction) + fraction / speedup)
