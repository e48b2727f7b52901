"""How big the KV pool and the host tier are, in one place.

The pool's size follows the memory budget (`EngineConfig.kv_memory_bytes`, plus what weight
offload frees) over the bytes one block takes in a KV format: the target's KV and, with a
draft model, its twin's; with layer groups (`free_window_kv`) a block is a page holding a
share of the layers. `set_up` prepares an executor for an engine and binds its pool in
the order sizing needs; `PoolSize.manager` makes the block manager of that pool. The knob
switches size the pool with it when the format or offload changes, and the knob checks
when they bound a knob by the pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.base import (
    Adapters,
    Executor,
    HostTier,
    Offload,
    TokenEviction,
    WeightFormats,
    WindowGroups,
    capability,
    draft_kv_bytes_per_token,
    has,
    resolve_weight_formats,
)
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.models.weight_formats import format_weight_format


def set_up(config: EngineConfig, executor: Executor) -> tuple[EngineConfig, PoolSize]:
    """Prepare `executor` for an engine of `config` and bind its pool and host tier, in
    the order sizing needs: weight formats, weight offload (it frees device memory the pool
    takes), layer groups, then the pool. Returns the config with its weight format resolved
    (what `measured` chose, written out) and the sizing."""
    k = config.knobs
    formats = resolve_weight_formats(executor, k.weight_format)
    if isinstance(executor, WeightFormats) and formats != executor.weight_formats:
        executor.set_weight_formats(formats)
    if k.offload_layers:
        capability(executor, Offload, "offload_layers").set_offload(k.offload_layers,
                                                                    k.offload_buffers)
    groups = capability(executor, WindowGroups, "free_window_kv").layer_groups() \
        if config.free_window_kv else None
    if groups is not None and config.host_kv_memory_bytes:
        raise ConfigError("free_window_kv cannot have a host KV tier: window pages are not "
                          "swapped or demoted; drop --host-kv-memory-gib or "
                          "--free-window-kv.")
    if config.eviction.on:
        _check_eviction(config, groups)
        capability(executor, TokenEviction, "kv_eviction").set_token_eviction(
            config.kv_eviction)
    elif has(executor, TokenEviction):  # an earlier engine may have set it
        executor.set_token_eviction("off")
    pool = PoolSize(config, executor, groups)
    executor.bind_kv(pool.blocks(k.kv_format), config.block_size, k.kv_format, groups=groups)
    host_blocks = pool.host_blocks(k.kv_format)
    if host_blocks or isinstance(executor, HostTier):  # 0 drops an earlier engine's tier
        capability(executor, HostTier, "--host-kv-memory-gib (host_kv_memory_bytes)"
                   ).bind_host_kv(host_blocks)
    text = format_weight_format(formats)
    if text != k.weight_format:  # knobs hold the resolved value
        config = dataclasses.replace(config, knobs=k.with_changes(weight_format=text))
    return config, pool


def _check_eviction(config: EngineConfig, groups: LayerGroups | None) -> None:
    """A ConfigError sentence for what token-level eviction cannot go with."""
    clash = "free_window_kv (--free-window-kv)" if groups is not None else \
        "a host KV tier (--host-kv-memory-gib)" if config.host_kv_memory_bytes else \
        "full reservation (--reservation full)" if config.knobs.reservation == "full" else None
    if clash:
        raise ConfigError(f"kv_eviction {config.kv_eviction} cannot go with {clash}: an "
                          "evicted block leaves a hole that neither window pages, swapping "
                          "nor a reservation of the whole context account for; drop one.")


class PoolSize:
    """Blocks, block bytes, host blocks and the cache namespace of each KV format."""

    def __init__(self, config: EngineConfig, executor: Executor, groups: LayerGroups | None):
        self.config, self.executor, self.groups = config, executor, groups

    def blocks(self, kv_format: str) -> int:
        """Blocks the pool holds in `kv_format`: the budget (plus what weight offload frees,
        less what LoRA adapters' slots take) over the bytes a block takes — the target's
        KV and, with a draft model, its twin's."""
        e = self.executor
        return self.config.blocks_for_budget(
            self.block_bytes(kv_format) // self.config.block_size
            + draft_kv_bytes_per_token(e, kv_format),
            (e.offload_gain_bytes if has(e, Offload) else 0)
            - (e.adapter_reserve_bytes if has(e, Adapters) else 0))

    def block_bytes(self, kv_format: str) -> int:
        """Bytes of the target's KV one block (one page, with layer groups: the layers of
        one page) takes in `kv_format`."""
        per_token = self.executor.kv_bytes_per_token(kv_format)
        if self.groups is not None:
            per_token = self.groups.page_share(per_token)
        return per_token * self.config.block_size

    def host_blocks(self, kv_format: str) -> int:
        """Blocks the host tier holds in `kv_format` (its own budget)."""
        return self.config.host_blocks(self.executor.kv_bytes_per_token(kv_format))

    def manager(self, clock: Callable[[], int]) -> BlockManager:
        """The block manager of the pool as bound (the config's KV format and prefix-cache
        knobs); `clock` is the engine's step number."""
        e, k = self.executor, self.config.knobs
        kv = BlockManager(
            self.blocks(k.kv_format), self.config.block_size,
            enable_caching=k.enable_prefix_caching, cache_capacity=k.prefix_cache_capacity,
            eviction_policy=k.eviction_policy, namespace=self.namespace(k.kv_format),
            bytes_per_block=self.block_bytes(k.kv_format),
            recompute_cost=lambda h, c: e.estimate_step_seconds(c, causal_pairs(c, h), h + c),
            clock=clock, host_blocks=self.host_blocks(k.kv_format),
            link_seconds=lambda nbytes: nbytes / e.info.link_bandwidth, groups=self.groups,
            eviction=self.config.eviction)
        kv.admission.configure(k.cache_admission_k, k.cache_admission_window)
        return kv

    def namespace(self, kv_format: str) -> str:
        """Cached KV is reusable only by the same model, format and namespace."""
        return f"{self.executor.info.model_name}|{kv_format}|{self.config.namespace}"
