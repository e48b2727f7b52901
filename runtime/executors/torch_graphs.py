"""CUDA graphs for the torch executor's decode steps (execution shapes, `--graph-buckets`).

A decode step of a small model on a GPU is mostly kernel launches: hundreds of small
kernels, each a few microseconds of work behind a launch the CPU pays for. A CUDA graph
records the launches of one step once and replays them with one call. A graph has fixed
shapes, so, as vLLM does, a step's rows are padded to the next captured size (`buckets`);
the padding is work done for nothing, reported as `StepTiming.padded_rows`.

What a graph holds here: the whole forward pass (embedding to the final hidden states) of a
step whose rows all decode one token. Each row reads its blocks as a `[rows, width]` table,
so the width (blocks read by the longest row) is a second shape: widths are rounded up to
1, 2, 3, 4, 6, 8, 12, … blocks (at most 1.5× the blocks a row needs, masked), and one
graph is captured per (rows, widths) on first use, in one shared memory pool. Sampling,
grammar masks and the logits head stay eager: they depend on each request.

Padding rows write their K/V into a spare block the pool has beyond its `num_blocks` (the
block manager never hands it out) and attend to its first key, so they touch no request's
KV. Steps that prefill, verify drafts, read tables with holes, apply adapters or stream
offloaded weights run eagerly, as do steps with more rows than the largest bucket.

A graph replays the tensors it was captured on: binding or converting the pool, changing
weight formats or offload drops every graph (`reset`). A capture that fails turns graphs
off for the executor with its reason (`lines`); steps then run eagerly."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvdeck.runtime.executors.paged_kv import PagedBatch, PagedKVCache, TableIndex
from kvdeck.runtime.planning.step_time import padded_rows

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, Callable], torch.Tensor]
Attend = Callable[..., torch.Tensor]
"""`attend(layer, q, k, v, batch)`: one layer's paged attention over `batch`'s tables."""


def width_bucket(width: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, … (powers of two and 1.5 times them) that
    is at least `width` blocks."""
    b = 1
    while b < width:
        if b >= 2 and b * 3 // 2 >= width:
            return b * 3 // 2
        b *= 2
    return b


@dataclass
class _Graph:
    """One captured step: its static inputs (written before each replay) and output."""

    graph: torch.cuda.CUDAGraph
    batch: PagedBatch
    hidden: torch.Tensor


class DecodeGraphs:
    """The captured decode graphs of one executor (module docstring)."""

    def __init__(self, buckets: tuple[int, ...], device: torch.device):
        """`buckets` (ascending row counts): graphs are on where there are some and the
        device is CUDA; elsewhere every step runs eagerly, as without them."""
        self.buckets = buckets
        self.device = device
        self.on = bool(buckets) and device.type == "cuda"
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None
        self.off = ""
        """Why graphs are off for good (a capture failed); empty while they are on."""
        self.replays = 0
        self.eager_steps = 0
        self.pool_bytes = 0
        """The most memory one capture had live beyond what was allocated before it (its
        warm-up excluded): what the shared pool holds for the graphs, their share of the
        footprint beside the weights and the KV pool."""

    def reset(self) -> None:
        """Drop every graph: the tensors they read are gone or changed."""
        if self.graphs:
            self.graphs.clear()
            self.pool = None
            self.pool_bytes = 0
            torch.cuda.empty_cache()

    def forward(self, batch: PagedBatch, kv: PagedKVCache, forward: Forward, attend: Attend,
                eager: bool = False) -> tuple[torch.Tensor, int]:
        """The final hidden states of `batch`'s rows and the padding rows run: by replaying
        (capturing first if needed) the graph of its shape where one can run it, else by
        `forward` itself. `eager`: what the batch does not show rules graphs out (adapters,
        offload)."""
        if self.on and not eager and self._fits(batch):
            out = self._replay(batch, kv, forward, attend)
            if out is not None:
                return out
        if self.on:
            self.eager_steps += 1
        return forward(batch.tokens, batch.positions, attend), 0

    def _fits(self, batch: PagedBatch) -> bool:
        """Every row decodes one token, no row reads a table with holes or is scored, no
        more rows than the largest bucket, and no capture has failed."""
        return (not self.off and batch.decode_rows is not None and not batch.prefills
                and not batch.verify and batch.scored is None
                and batch.tokens.numel() <= self.buckets[-1])

    def _replay(self, batch: PagedBatch, kv: PagedKVCache, forward: Forward, attend: Attend
                ) -> tuple[torch.Tensor, int] | None:
        """Replay the graph of `batch`'s shape; None when its capture failed (graphs are
        then off for good)."""
        n = batch.tokens.numel()
        rows = padded_rows(n, self.buckets)
        widths = tuple((key, width_bucket(ix.decode_blocks.shape[1]))
                       for key, ix in sorted(batch.tables.items()))
        key = (rows, widths)
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self._capture(rows, dict(widths), batch, kv, forward, attend)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                self.off = f"a CUDA graph of {rows} rows failed to capture ({e})"
                log.warning("decode graphs off: %s", self.off)
                self.reset()
                return None
            self.graphs[key] = g
        _fill(g.batch, batch, n, kv)
        g.graph.replay()
        self.replays += 1
        return g.hidden[:n], rows - n

    def _capture(self, rows: int, widths: dict[int, int], like: PagedBatch,
                 kv: PagedKVCache, forward: Forward, attend: Attend) -> _Graph:
        """Static inputs for `rows` rows at `widths`, filled as padding (so the warm-up
        and the capture write only the spare block), then the forward pass recorded."""
        spare, p, dev = kv.spare_block, kv.block_size, self.device
        tables = {}
        for key, ix in like.tables.items():
            w = widths[key]
            masks = {window: torch.zeros(rows, 1, 1, w * p, dtype=torch.bool, device=dev)
                     for window in ix.decode_masks}
            for m in masks.values():
                m[:, ..., 0] = True
            tables[key] = TableIndex(torch.full((rows,), spare * p, device=dev),
                                     torch.full((rows, w), spare, device=dev), masks, [], [])
        static = PagedBatch(torch.zeros(rows, dtype=torch.long, device=dev),
                            torch.zeros(rows, dtype=torch.long, device=dev),
                            torch.zeros(0, dtype=torch.long, device=dev), [],
                            decode_rows=torch.arange(rows, device=dev), tables=tables,
                            groups=like.groups)

        def run() -> torch.Tensor:
            return forward(static.tokens, static.positions,
                           lambda layer, q, k, v: attend(layer, q, k, v, static))

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: lazy initialisations happen outside
            run()
        torch.cuda.current_stream(dev).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the grammar-mask thread may touch CUDA while this one captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden = run()
        self.pool_bytes = max(self.pool_bytes, torch.cuda.max_memory_allocated(dev) - before)
        return _Graph(graph, static, hidden)

    def lines(self) -> tuple[str, ...]:
        """The graphs' state as a line beside the kernels' (none where they are not on):
        sizes, graphs held, steps replayed and run eagerly."""
        if not self.on:
            return ()
        if self.off:
            return (f"CUDA graphs off: {self.off}",)
        sizes = ",".join(map(str, self.buckets))
        return (f"CUDA graphs at {sizes} rows: {len(self.graphs)} captured "
                f"({self.pool_bytes / 2**20:,.1f} MiB), {self.replays} decode steps replayed, "
                f"{self.eager_steps} eager",)


def _fill(static: PagedBatch, batch: PagedBatch, n: int, kv: PagedKVCache) -> None:
    """Write `batch`'s `n` rows into a graph's static inputs, and padding after them."""
    spare, p = kv.spare_block, kv.block_size
    static.tokens[:n].copy_(batch.tokens)
    static.tokens[n:].zero_()
    static.positions[:n].copy_(batch.positions)
    static.positions[n:].zero_()
    for key, ix in batch.tables.items():
        s = static.tables[key]
        w = ix.decode_blocks.shape[1]
        s.slots[:n].copy_(ix.slots)
        s.slots[n:].fill_(spare * p)
        s.decode_blocks[:n, :w].copy_(ix.decode_blocks)
        s.decode_blocks[:n, w:].fill_(spare)
        s.decode_blocks[n:].fill_(spare)
        for window, m in s.decode_masks.items():
            real = ix.decode_masks[window]
            m[:n, ..., :real.shape[-1]].copy_(real)
            m[:n, ..., real.shape[-1]:].fill_(False)
            m[n:].fill_(False)
            m[n:, ..., 0] = True
