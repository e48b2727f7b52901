"""What moved between device and host: per-step totals, running counters and the view the
transfers panel, the KV map and `/metrics` read.

The live engine and replay feed the same `TransferLog` with each step's `transfers.Transfer`
list, so a replayed console shows the figures the live one showed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple


class Transfer(NamedTuple):
    """One copy between device and host during a step (`StepResult.transfers`)."""

    kind: str
    """`swap` (a preempted request's KV), `demote` / `promote` (a cached prefix block),
    `weights` (an offloaded layer's FFN matrices), `lora` (a LoRA adapter loaded for a
    slot), `lora unload` (one unloaded from its slot: no bytes move, the host keeps it)."""
    direction: str
    """`d2h` or `h2d`."""
    what: str
    """The request id, `node N`, or `layer N ffn`."""
    blocks: int
    """KV blocks copied (0 for weights)."""
    bytes: int
    start: float
    """Seconds from the start of the step (modelled under `sim`, measured otherwise)."""
    seconds: float
    bound: float
    """The lower bound `bytes / link bandwidth`."""
    stall: float
    """Seconds the step waited for this copy: all of it for KV copies (they precede the
    forward pass) and for weights with one buffer; with two, only what the compute of the
    layer before did not hide."""


RECENT_STEPS = 48
"""Steps with transfers the panel's history keeps."""


@dataclass(frozen=True)
class StepTransfers:
    """One step's copies, summed."""

    step: int
    d2h_bytes: int
    h2d_bytes: int
    seconds: float
    """Copy time (the copies' durations added up)."""
    bound: float
    """Σ bytes / link bandwidth: no copy can be faster."""
    stall: float
    """Seconds the step waited for copies (less than `seconds` when prefetch overlapped)."""
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class TransfersView:
    """The host tier, the link and what crossed it."""

    link_bandwidth: float
    """Bytes/s one way (measured at start-up, or the hardware profile's under `sim`)."""
    link_detail: str
    host_blocks: int
    host_swapped: int
    host_demoted: int
    host_bytes_per_block: int
    host_states: bytes
    """One byte per host block: 0 free, 1 swapped, 2 demoted (`kv/tiers.py`)."""
    swapped_requests: tuple[str, ...]
    """Requests whose KV is on the host now."""
    counters: dict
    """Since start: swap_outs, swap_ins, demotions, promotions, host_hit_tokens, d2h_bytes
    and h2d_bytes (KV), weight_bytes (prefetched weights), copy_seconds, stall_seconds."""
    last: StepTransfers | None
    """The latest step that moved anything."""
    recent: tuple[StepTransfers, ...]
    offload: str = ""
    """Weight offload, described (empty: none)."""
    offload_gain_bytes: int = 0
    """Device bytes offload gave to the KV pool (offloaded − buffer bytes)."""

    @property
    def host_bytes(self) -> int:
        """Bytes the host tier holds now (`kvdeck:host_tier_bytes`)."""
        return (self.host_swapped + self.host_demoted) * self.host_bytes_per_block


def host_checkpoint(num_blocks: int, tables: dict[str, list[int]], swap_outs: int,
                    swap_ins: int, log: TransferLog) -> dict:
    """A checkpoint's `host` entry (`checkpoint.Checkpoint.host`), the same from the live
    engine and from replay."""
    return {"num_blocks": num_blocks, "tables": {rid: list(t) for rid, t in tables.items()},
            "counters": {"swap_outs": swap_outs, "swap_ins": swap_ins},
            "transfers": log.to_json()}


class TransferLog:
    """Running counters and recent history of transfers."""

    def __init__(self) -> None:
        self.recent: deque[StepTransfers] = deque(maxlen=RECENT_STEPS)
        self.last: StepTransfers | None = None
        self.counters = {"d2h_bytes": 0, "h2d_bytes": 0, "weight_bytes": 0,
                         "copy_seconds": 0.0, "stall_seconds": 0.0}

    def on_step(self, step: int, transfers: list[Transfer]) -> None:
        if not transfers:
            return
        d2h = sum(t.bytes for t in transfers if t.direction == "d2h")
        h2d = sum(t.bytes for t in transfers if t.direction == "h2d")
        weights = sum(t.bytes for t in transfers if t.kind in ("weights", "lora"))
        seconds = sum(t.seconds for t in transfers)
        stall = sum(t.stall for t in transfers)
        entry = StepTransfers(step, d2h, h2d, seconds, sum(t.bound for t in transfers),
                              stall, tuple(transfers))
        self.last = entry
        self.recent.append(entry)
        c = self.counters
        c["d2h_bytes"] += d2h  # KV only: weights are only ever copied in
        c["h2d_bytes"] += h2d - weights
        c["weight_bytes"] += weights
        c["copy_seconds"] += seconds
        c["stall_seconds"] += stall

    def view_counters(self, swap_outs: int, swap_ins: int, tree) -> dict:
        """`TransfersView.counters`: this log's, the swaps and the prefix tree's host-tier
        counts (a `PrefixTree`, live or replayed)."""
        return {**self.counters, "swap_outs": swap_outs, "swap_ins": swap_ins,
                "demotions": tree.num_demotions, "promotions": tree.num_promotions,
                "host_hit_tokens": tree.num_host_hit_tokens}

    def to_json(self) -> dict:
        """Counters and recent history (a checkpoint's, so a replay starting mid-run shows
        what the live panel showed)."""
        recent = [[s.step, s.d2h_bytes, s.h2d_bytes, s.seconds, s.bound, s.stall,
                   [list(t) for t in s.transfers]] for s in self.recent]
        return {"counters": dict(self.counters), "recent": recent}

    def load(self, data: dict) -> None:
        self.counters.update(data["counters"])
        for step, d2h, h2d, seconds, bound, stall, items in data["recent"]:
            entry = StepTransfers(step, d2h, h2d, seconds, bound, stall,
                                  tuple(Transfer(*t) for t in items))
            self.recent.append(entry)
            self.last = entry
