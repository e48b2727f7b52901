"""Knob switches between iterations, and the frozen record each one leaves.

Three knobs change what the executor holds rather than how the scheduler plans: the KV
format (the pool is re-encoded in place), the weight format (matrices are re-packed from
the host master copy) and weight offload (FFN weights move to or from the host, and the
memory that frees or takes re-lays the pool). `KnobSwitches` performs them between
iterations, on the engine thread, and describes each one as a `Switch` (`core/switch.py`,
frozen, with its JSON form): the step record
carries it (`StepRecord.switches`, in its JSON form), the snapshots show the latest eight,
and replay reads them back.

Converted in place rather than drained and re-laid: a running request keeps its KV,
re-encoded, instead of being preempted and recomputed — conversion reads and writes each
used block once (a memory-bound pass), far cheaper than recomputing every context (a
forward pass over all of them) — and cached prefixes stay, filed under the new format's
namespace, so old and new formats never mix. The block count follows the memory budget
(`core/pool_size.py`): a smaller format buys more blocks, a larger one fewer; when fewer
than are in use, cached blocks are dropped first (eviction order) and then the most
recently admitted requests are preempted (recompute) until the rest fit. The host tier is
emptied first — swapped requests recompute, demoted prefixes are dropped — and re-laid at
the new block size: its copies are in the old layout.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

from kvdeck.runtime.core.clock import WallClock
from kvdeck.runtime.core.config import Knobs
from kvdeck.runtime.core.pool_size import PoolSize
from kvdeck.runtime.core.scheduler import Scheduler
from kvdeck.runtime.core.step_data import Conversion
from kvdeck.runtime.core.switch import RECENT, Switch
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.base import (
    Executor,
    HostTier,
    KVConversion,
    Offload,
    WeightFormats,
    WeightsView,
    capability,
    resolve_weight_formats,
)
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.models.weight_formats import format_weight_format, parse_weight_format

log = logging.getLogger("kvdeck.engine")


class KnobSwitches:
    """Performs the switches of one engine and keeps what they leave: the format the pool
    holds, its bytes per token, the weights view and the recent switches."""

    def __init__(self, executor: Executor, kv: BlockManager, scheduler: Scheduler,
                 clock: WallClock, pool: PoolSize, stop: threading.Event, kv_format: str):
        self.executor, self.kv, self.scheduler = executor, kv, scheduler
        self.clock, self.pool, self.stop = clock, pool, stop
        self.kv_format = kv_format
        """The format the pool holds now (the knob's value once a change has applied)."""
        self.kv_bytes_per_token = executor.kv_bytes_per_token(kv_format)
        self.recent: deque[Switch] = deque(maxlen=RECENT)
        """The latest switches, each with the step it happened before."""
        self.weights_view: WeightsView = executor.describe_weights(kv_format)
        """What snapshots show of the weights (refreshed after every switch: it reads cached
        quality figures from disk)."""

    def submit(self, knobs: Knobs, changes: dict[str, Any]) -> Knobs:
        """`knobs` with `changes`, checked (ConfigError if broken); a weight format is
        stored resolved, so what is pending shows what will apply."""
        new = knobs.with_changes(**changes)
        if "weight_format" in changes:
            formats = resolve_weight_formats(self.executor, new.weight_format,
                                             parse_weight_format(knobs.weight_format))
            new = new.with_changes(weight_format=format_weight_format(formats))
        self.check(new)
        return new

    def check(self, knobs: Knobs) -> None:
        """Bounds that depend on this engine's executor and pool (ConfigError if broken)."""
        if knobs.reservation == "full" and self.kv.eviction.on:
            raise ConfigError("reservation full cannot go with kv_eviction: an evicted block "
                              "leaves a hole a reservation of the whole context does not "
                              "account for; use lazy.")
        if knobs.preemption != "recompute" and self.pool.groups is not None:
            raise ConfigError(f"preemption {knobs.preemption} needs a host KV tier, which "
                              "free_window_kv rules out (window pages are not swapped); use "
                              "recompute.")
        if knobs.preemption != "recompute" and not self.kv.has_host_tier:
            raise ConfigError(f"preemption {knobs.preemption} needs a host KV tier; give it "
                              "--host-kv-memory-gib (setting host_kv_memory_bytes) of at least "
                              f"one block ({self.kv.bytes_per_block:,} bytes), or use "
                              "recompute.")
        if knobs.speculative_method == "draft" and not self.executor.info.draft_model_name:
            how = "--draft-cost C (a modelled draft)" if self.executor.info.virtual_time else \
                "--draft-model NAME|PATH (a GGUF sharing the model's tokenizer)"
            raise ConfigError(f"speculative_method draft needs a draft model; start with "
                              f"{how}, or use ngram.")
        info = self.executor.info
        if knobs.max_num_seqs > info.max_sequences:
            raise ConfigError(f"max_num_seqs must be at most {info.max_sequences} with "
                              f"{info.name} (its slots, --n-parallel), got "
                              f"{knobs.max_num_seqs}.")
        if knobs.offload_layers:
            capability(self.executor, Offload, "offload_layers")
        if knobs.offload_layers > info.num_layers:
            raise ConfigError(f"offload_layers must be from 0 to {info.num_layers} "
                              f"(the model's layers), got {knobs.offload_layers}.")
        blocks = self.kv.num_blocks
        if knobs.kv_format != self.kv_format:
            capability(self.executor, KVConversion, "changing kv_format live")
            # The executor refuses a format it cannot store; the budget must buy a block.
            blocks = self.pool.blocks(knobs.kv_format)
        if knobs.prefix_cache_capacity > blocks:
            raise ConfigError(f"prefix_cache_capacity must be from 0 to {blocks:,} (the pool's "
                              f"blocks), got {knobs.prefix_cache_capacity:,}.")

    def apply(self, knobs: Knobs, step: int) -> list[Switch]:
        """Switch whatever `knobs` change, KV format first; returns the switches made."""
        made = []
        if knobs.kv_format != self.kv_format:
            made.append(self._kv(knobs.kv_format))
        old = self.scheduler.knobs
        if knobs.weight_format != old.weight_format:
            made.append(self._weights(old.weight_format, knobs.weight_format))
        if (knobs.offload_layers, knobs.offload_buffers) != \
                (old.offload_layers, old.offload_buffers):
            made.append(self._offload(old, knobs))
        for switch in made:
            self.recent.append(switch.at(step))
        if made:
            self.weights_view = self.executor.describe_weights(self.kv_format)
        return made

    def _kv(self, kv_format: str) -> Switch:
        old = self.kv_format
        num_blocks = self.pool.blocks(kv_format)
        conv, fields_ = self._relayout(kv_format, num_blocks, f"{old} → {kv_format}")
        self._pause(conv.seconds)
        log.info("kv_format %s → %s: %d blocks converted in %.3f s, pool %d blocks",
                 old, kv_format, fields_["blocks"], conv.seconds, num_blocks)
        return Switch("kv_format", old, kv_format, conv.seconds, conv.measured,
                      conv.bytes_read + conv.bytes_written, **fields_)

    def _relayout(self, kv_format: str, num_blocks: int, why: str
                  ) -> tuple[Conversion, dict[str, Any]]:
        """Re-lay the pool as `num_blocks` blocks in `kv_format` (module docstring).
        Returns the conversion and the switch's pool fields."""
        kv, now = self.kv, self.clock.now()
        unswapped = self.scheduler.unswap_all(now, why)
        kv.swaps.drop_host_tier(kv.host.num_blocks)
        preempted = self.scheduler.preempt_to_fit(
            num_blocks, now, f"the pool shrank to {num_blocks:,} blocks ({why})")
        dropped = 0
        demote, kv.tree.demote = kv.tree.demote, False
        while kv.num_used_blocks > num_blocks and kv.tree.evict_one() is not None:
            dropped += 1
        kv.tree.demote = demote
        where = kv.relayout(num_blocks, self.pool.block_bytes(kv_format),
                            self.pool.namespace(kv_format))
        src = sorted(where)
        conv = capability(self.executor, KVConversion, "changing kv_format live").convert_kv(
            kv_format, num_blocks, src, [where[b] for b in src])
        host_blocks = self.pool.host_blocks(kv_format)
        kv.swaps.drop_host_tier(host_blocks)
        if isinstance(self.executor, HostTier):
            self.executor.bind_host_kv(host_blocks)
        self.kv_format = kv_format
        self.kv_bytes_per_token = self.executor.kv_bytes_per_token(kv_format)
        return conv, {"blocks": len(src), "moved": sum(b != where[b] for b in src),
                      "num_blocks": num_blocks, "dropped": dropped,
                      "preempted": tuple(preempted), "unswapped": tuple(unswapped)}

    def fit_pool(self, why: str) -> Conversion | None:
        """Re-lay the pool at the size its budget buys now, after device memory outside the
        knobs changed hands (LoRA adapters loaded: `Session.load_adapters`); None when the
        size stayed."""
        num_blocks = self.pool.blocks(self.kv_format)
        if num_blocks == self.kv.num_blocks:
            return None
        conv, _ = self._relayout(self.kv_format, num_blocks, why)
        log.info("pool re-laid for %s: %d blocks", why, num_blocks)
        return conv

    def _offload(self, old: Knobs, knobs: Knobs) -> Switch:
        """Move FFN weights to or from the host and give the device memory that frees (or
        take back what it needs) to the KV pool, re-laid in place."""
        ex = capability(self.executor, Offload, "offload_layers")
        conv = ex.set_offload(knobs.offload_layers, knobs.offload_buffers)
        self._pause(conv.seconds)
        num_blocks = self.pool.blocks(self.kv_format)
        seconds, fields_ = conv.seconds, {}
        if num_blocks != self.kv.num_blocks:
            relaid, fields_ = self._relayout(self.kv_format, num_blocks, "weight offload")
            self._pause(relaid.seconds)
            seconds += relaid.seconds
        switch = Switch(
            "offload_layers", f"{old.offload_layers} layers, {old.offload_buffers} buffers",
            f"{knobs.offload_layers} layers, {knobs.offload_buffers} buffers", seconds,
            conv.measured, conv.bytes_written, bytes_before=conv.bytes_read,
            offload=ex.describe_offload(), gain=ex.offload_gain_bytes,
            **{**fields_, "num_blocks": num_blocks})
        log.info("offload %s → %s: %.3f s, pool %d blocks", switch.old, switch.new, seconds,
                 num_blocks)
        return switch

    def _weights(self, old: str, text: str) -> Switch:
        """Re-pack the matrices whose group changes format from the executor's host master
        copy; requests wait meanwhile (nobody is preempted: the KV does not change)."""
        conv = capability(self.executor, WeightFormats, f"weight_format {text}"
                          ).set_weight_formats(parse_weight_format(text))
        self._pause(conv.seconds)
        log.info("weight_format %s → %s: re-packed in %.3f s, %d → %d bytes", old, text,
                 conv.seconds, conv.bytes_read, conv.bytes_written)
        return Switch("weight_format", old, text, conv.seconds, conv.measured,
                      conv.bytes_written, bytes_before=conv.bytes_read)

    def _pause(self, seconds: float) -> None:
        """A switch's pause takes modelled time on a virtual clock (measured time passes by
        itself)."""
        if self.executor.info.virtual_time:
            self.clock.pin()
            self.clock.advance(seconds)
            self.clock.wait_until_due(self.stop)
