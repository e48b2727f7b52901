"""llama-server's saves of its idle slots to its host prompt cache: what one takes, and
what the probes paid for them.

Before a new request's first step, llama-server (with its prompt cache on: `--cache-ram`,
8 GiB by default) saves every idle slot whose tokens the cache does not hold yet, and its
loop waits (`executors/server_slots.py`). A slot's state is its sequence's KV: every token
in the global layers, the window in the sliding ones (`ModelProfile.kv_bytes` with blocks
of one token, as llama-server's log gives its size), and a save takes time in proportion to
it.

`kvdeck calibrate --url` times one (`probe.save_point`), the profile keeps it as
`[slot_save.<hardware>]` (`points`: [tokens, milliseconds]), and the sim holds its loop for
the saves a launch makes. The probes' own requests paid such saves before their first
tokens, which `SlotSaves` takes out of their points, so the fitted steps hold none of it.
How long a save took, and why the sim holds a launch for it: `executors/server_slots.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvdeck.runtime.planning.profile_tables import number, point_tables, whole

if TYPE_CHECKING:
    from kvdeck.runtime.planning.profiles import ModelProfile
    from kvdeck.runtime.runs.trace import Arrival

SlotSave = tuple[tuple[int, float], ...]
"""(tokens of a slot's state, seconds its save took)."""


def save_seconds(model: ModelProfile, points: SlotSave) -> Callable[[int], float]:
    """Seconds to save a slot's state of n tokens: its bytes at the rate the points
    measured (their bytes over their seconds)."""
    done = sum(model.kv_bytes(n, 1) for n, _ in points)
    took = sum(s for _, s in points)
    per_byte = took / done if done else 0.0
    return lambda n: model.kv_bytes(n, 1) * per_byte if n > 0 else 0.0


def slot_save_tables(d: dict, where: str) -> dict[str, SlotSave]:
    """A model profile's `[slot_save.<hardware>]` tables (`points`, [tokens, milliseconds]
    pairs) by hardware name."""
    return {hw: tuple((n, ms / 1e3) for n, ms in points) for hw, points in point_tables(
        d, where, "slot_save", 2, lambda p: whole(p[0]) and number(p[1]) and p[0] > 0
        and p[1] > 0, "[tokens, milliseconds] pairs (tokens a whole number above 0, "
        "milliseconds above 0)").items()}


def state_tokens(a: Arrival) -> int:
    """The tokens of the slot state `a` leaves: its prompt and outputs but the last, which
    never ran through the model (llama-server saves 799 of a 768-token prompt and 32
    outputs)."""
    return a.prompt_len + a.output_len - 1


class SlotSaves:
    """The saves each probe request paid at its launch: a launch saves the states that
    requests ended since the one before it left (`state_tokens`). Probe requests are sent
    one at a time, or together."""

    def __init__(self, seconds: Callable[[int], float]):
        self.seconds = seconds
        self.pending: list[int] = []
        """Tokens of each slot state left since the last launch."""

    def _launch(self) -> float:
        paid = sum(map(self.seconds, self.pending))
        self.pending = []
        return paid

    def one_by_one(self, arrivals: Sequence[Arrival]) -> list[float]:
        """`arrivals` sent each after the one before ended: each pays for the one before."""
        paid = []
        for a in arrivals:
            paid.append(self._launch())
            self.pending = [state_tokens(a)]
        return paid

    def sharing(self, a: Arrival) -> float:
        """`a` sent after the one before ended, its prompt sharing that one's prefix:
        llama-server gives it that request's slot to reuse its tokens, and saves the other
        states left but not that one."""
        paid = sum(map(self.seconds, self.pending[:-1]))
        self.pending = [state_tokens(a)]
        return paid

    def together(self, arrivals: Sequence[Arrival]) -> list[float]:
        """`arrivals` sent at once: the first launched pays for what was left before."""
        paid = [self._launch()] + [0.0] * (len(arrivals) - 1)
        self.pending = list(map(state_tokens, arrivals))
        return paid

    def beside(self, first: Arrival, rest: Sequence[Arrival]) -> list[float]:
        """`first` sent, then `rest` one at a time while it runs (each after the one before
        ended): the first pays for what was left before, each of the rest for the one
        before it (the first of them for none)."""
        paid = [self._launch(), 0.0]
        for before in rest[:-1]:
            paid.append(self.seconds(state_tokens(before)))
        self.pending = [state_tokens(a) for a in (first, *rest[-1:])]
        return paid[:1 + len(rest)]
