"""How big the KV pool and the host tier are, in one place.

The pool's size follows the memory budget (`EngineConfig.kv_memory_bytes`, plus what weight
offload frees) over the bytes one block takes in a KV format: the target's KV and, with a
draft model, its twin's; with layer groups (`free_window_kv`) a block is a page holding a
share of the layers. The engine sizes the pool with it at start, the knob switches when the
format or offload changes, and the knob checks when they bound a knob by the pool.
"""

from __future__ import annotations

from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.executors.base import Executor
from kvdeck.runtime.kv.groups import LayerGroups


class PoolSize:
    """Blocks, block bytes, host blocks and the cache namespace of each KV format."""

    def __init__(self, config: EngineConfig, executor: Executor, groups: LayerGroups | None):
        self.config, self.executor, self.groups = config, executor, groups

    def blocks(self, kv_format: str) -> int:
        """Blocks the pool holds in `kv_format`: the budget (plus what weight offload frees)
        over the bytes a block takes — the target's KV and, with a draft model, its
        twin's."""
        e = self.executor
        return self.config.blocks_for_budget(
            self.block_bytes(kv_format) // self.config.block_size
            + e.draft_kv_bytes_per_token(kv_format), e.offload_gain_bytes)

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

    def namespace(self, kv_format: str) -> str:
        """Cached KV is reusable only by the same model, format and namespace."""
        return f"{self.executor.model_name}|{kv_format}|{self.config.namespace}"
