"""Layer groups of a model mixing full-attention and sliding-window layers, and the page
layout that lets the two groups share one pool (`free_window_kv`).

A sliding-window layer's query at position q reads only keys q − w + 1 … q, so once every
query a request can still schedule has moved past a block, the local layers' copy of that
block is dead weight. Freeing it needs the local layers' KV in blocks of their own, apart
from the full-attention (global) layers' blocks, which hold the whole history.

The two groups share one pool of *pages*, as vLLM's hybrid allocator does, so capacity is
never split ahead of time between them: a page holds `page_layers` layers of one block
(`block_size` tokens), and `page_layers` is the number of global layers. A global block is
one page (all global layers); a local block is `pages_per_local_block` pages, the local
layers cut into sub-groups of `page_layers` (the last one padded when they do not divide).
The executor keeps one K and one V tensor per page slot (`[num_pages, block_size, …]`), and
global layer i reads slot i through the request's global table while local layer j reads
slot j % page_layers through its sub-group's table (j // page_layers).

Gemma 3 270M: 3 global and 15 local layers, a 512-token window → pages of 3 layers, a
local block is 5 pages. At context L (block size p) a request holds L/p global pages but
only about ⌈(w − 1)/p⌉ + 1 local blocks, so its pages fall from 6·L/p (every layer keeping
everything) to L/p + 5·(⌈(w − 1)/p⌉ + 1): about 4.6× fewer at 8K.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvdeck.runtime.errors import ConfigError


@dataclass(frozen=True)
class LayerGroups:
    """Which layers are global and which local, and where each one's KV lives in a page."""

    num_layers: int
    local_layers: tuple[int, ...]
    window: int
    """Keys a local layer's query sees, itself included."""

    # Derived once (the block manager and every layer of every step read them).
    @cached_property
    def global_layers(self) -> tuple[int, ...]:
        local = set(self.local_layers)
        return tuple(i for i in range(self.num_layers) if i not in local)

    @cached_property
    def page_layers(self) -> int:
        """Layers one page holds: the number of global layers."""
        return len(self.global_layers)

    @cached_property
    def pages_per_local_block(self) -> int:
        return -(-len(self.local_layers) // self.page_layers)

    @cached_property
    def _places(self) -> dict[int, tuple[int, int]]:
        g = self.page_layers
        places = {layer: (-1, i) for i, layer in enumerate(self.global_layers)}
        places.update((layer, (j // g, j % g)) for j, layer in enumerate(self.local_layers))
        return places

    def place(self, layer: int) -> tuple[int, int]:
        """(table, slot) of `layer`: table −1 is the global table, t ≥ 0 the local
        sub-group t's table; slot is the layer's place within the page."""
        return self._places[layer]

    def page_share(self, nbytes: int) -> int:
        """Of `nbytes` spread evenly over every layer (a token's KV), what one page's
        layers hold."""
        return nbytes * self.page_layers // self.num_layers

    def first_live_block(self, position: int, block_size: int) -> int:
        """The first block a local query at `position` (or later) reads."""
        return max(0, position - self.window + 1) // block_size

    def pages_held(self, num_tokens: int, block_size: int) -> tuple[int, int]:
        """(global pages, local pages) a request of `num_tokens` computed tokens holds
        once its local blocks behind the window are freed — the figure the KV map's counts
        should show for one request alone."""
        nb = -(-num_tokens // block_size)
        live = nb - self.first_live_block(num_tokens, block_size) if nb else 0
        return nb, live * self.pages_per_local_block

    def describe(self) -> str:
        return (f"{len(self.global_layers)} full-attention and {len(self.local_layers)} "
                f"sliding-window layers (window {self.window:,}); a page holds "
                f"{self.page_layers} layer{'s' if self.page_layers > 1 else ''}, a local block "
                f"{self.pages_per_local_block} pages")


def layer_groups(num_layers: int, local_layers: tuple[int, ...], window: int | None,
                 model: str) -> LayerGroups:
    """The groups of a model, or a ConfigError sentence when it has nothing to free."""
    if not window or not local_layers:
        raise ConfigError(f"free_window_kv needs a model with sliding-window layers; "
                          f"{model} attends over the whole context in every layer.")
    if len(local_layers) == num_layers:
        raise ConfigError(f"free_window_kv needs a model mixing full-attention and "
                          f"sliding-window layers; every layer of {model} is sliding-window.")
    return LayerGroups(num_layers, tuple(local_layers), int(window))
