"""Immutable views of the engine after an iteration, for the console, exporters and tests.

Consumers read snapshots only; they never reach into the scheduler or the KV manager.
Block states are packed one byte per block:

    FREE 0           no reference
    PRIVATE 1        one request uses it, not in the prefix cache
    SHARED 2         two or more requests use it
    CACHED 3         only the prefix cache holds it: evictable
    CACHED_ACTIVE 4  in the prefix cache and used by one request
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.config import Knobs
from runtime.kv.manager import BlockManager
from runtime.kv.prefix_tree import NodeSummary
from runtime.request import Request

FREE, PRIVATE, SHARED, CACHED, CACHED_ACTIVE = range(5)
STATE_NAMES = ("free", "private", "shared", "cached", "cached_active")


def block_states(refcount: list[int], cached: bytearray) -> bytes:
    """Pack per-block states from refcounts and cache flags (vectorized: ~1 ms per 40K)."""
    rc = np.asarray(refcount, dtype=np.int32)
    c = np.frombuffer(bytes(cached), dtype=np.uint8).astype(np.int32)
    users = rc - c
    out = np.full(rc.shape, PRIVATE, dtype=np.uint8)
    out[users >= 2] = SHARED
    out[(users == 1) & (c == 1)] = CACHED_ACTIVE
    out[(users == 0) & (c == 1)] = CACHED
    out[rc == 0] = FREE
    return out.tobytes()


@dataclass(frozen=True)
class RequestView:
    request_id: str
    status: str
    prompt_tokens: int
    computed_tokens: int
    output_tokens: int
    max_tokens: int
    cached_tokens: int
    arrival_time: float
    admitted_time: float | None
    deadline: float | None
    priority: int
    num_preemptions: int
    block_table: tuple[int, ...]

    @classmethod
    def of(cls, req: Request, table: list[int] | None) -> RequestView:
        return cls(req.request_id, req.status.value, req.num_prompt_tokens,
                   req.num_computed_tokens, req.num_output_tokens, req.sampling.max_tokens,
                   req.num_cached_tokens, req.arrival_time, req.admitted_time, req.deadline,
                   req.priority, req.num_preemptions, tuple(table or ()))


@dataclass(frozen=True)
class BatchView:
    """The last iteration's composition against its budgets."""

    step: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_seqs: int
    token_budget: int
    max_num_seqs: int
    seconds: float
    num_preempted: int

    @property
    def unused_budget(self) -> int:
        return max(self.token_budget - self.num_decode_tokens - self.num_prefill_tokens, 0)


@dataclass(frozen=True)
class KVView:
    num_blocks: int
    block_size: int
    kv_format: str
    bytes_per_block: int
    states: bytes
    num_free: int
    num_evictable: int
    num_reserved: int
    usage: float
    num_cached_blocks: int
    hit_rate: float
    num_evictions: int
    num_cow_copies: int

    @classmethod
    def of(cls, kv: BlockManager, kv_format: str) -> KVView:
        return cls(kv.num_blocks, kv.block_size, kv_format, kv.bytes_per_block,
                   block_states(kv.pool.refcount, kv.pool.cached), kv.pool.num_free,
                   kv.tree.num_evictable, kv.num_reserved, kv.usage, kv.tree.num_nodes,
                   kv.tree.hit_rate, kv.tree.num_evictions, kv.num_cow_copies)


@dataclass(frozen=True)
class EngineSnapshot:
    """Everything the console shows, as of the end of iteration `step`."""

    step: int
    time: float
    """Engine clock (virtual seconds under `sim`)."""
    model_name: str
    executor: str
    knobs: Knobs
    waiting: tuple[RequestView, ...]
    running: tuple[RequestView, ...]
    batch: BatchView | None
    kv: KVView
    prefix_nodes: tuple[NodeSummary, ...]
    num_finished: int
    num_rejected: int
    num_aborted: int
    num_preemptions: int
    recent: dict
    """Rolling metrics over recently finished requests (see `Engine.rolling_metrics`)."""
