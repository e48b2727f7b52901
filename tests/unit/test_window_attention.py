"""Grouped pages read like one pool: `paged_attention` over a pool laid out in layer groups
(`kv/groups.py`), local tables holding only the window's pages, gives every layer the
attention the one-group pool gives, and never reads a freed page or an unused slot; the
executors that cannot lay out groups say why."""

from __future__ import annotations

import random

import pytest
import torch

from kvdeck.runtime.executors.kv_codecs import get_codec
from kvdeck.runtime.executors.paged_kv import BatchRow, PagedBatch, PagedKVCache, paged_attention
from kvdeck.runtime.kv.groups import LayerGroups

CPU = torch.device("cpu")
P, W = 4, 8                    # block size, window
HEADS, KV_HEADS, D = 4, 2, 8
GROUPS = LayerGroups(num_layers=8, local_layers=(1, 2, 3, 5, 6), window=W)
SCALE = D ** -0.5


def window(layer: int) -> int | None:
    return W if layer in GROUPS.local_layers else None


def pool(num_layers: int, num_pages: int, gen: torch.Generator) -> PagedKVCache:
    """A pool whose every slot holds finite garbage (large, so a key read unmasked shows)."""
    kv = PagedKVCache(num_layers, num_pages, P, KV_HEADS, D, get_codec("fp32", D, CPU), CPU)
    for layer in kv.k + kv.v:
        layer[0].copy_(torch.randn(layer[0].shape, generator=gen) * 100)
    return kv


def poison(kv: PagedKVCache, slots: range, pages: list[int]) -> None:
    for s in slots:
        for part in (kv.k[s][0], kv.v[s][0]):
            part[pages] = float("nan")


def slots_of(table: list[int], positions: range) -> torch.Tensor:
    return torch.tensor([table[x // P] * P + x % P for x in positions], dtype=torch.long)


def run(spans: list[tuple[int, int]], seed: int = 0) -> None:
    """Rows (start, new tokens), their earlier tokens' K/V cached: every layer's attention
    through the one-group pool and through the grouped one, compared."""
    gen = torch.Generator().manual_seed(seed)
    order = random.Random(seed)
    L = GROUPS.num_layers
    nblocks = [-(-(s + n) // P) for s, n in spans]
    k = [[torch.randn(s + n, KV_HEADS, D, generator=gen) for s, n in spans] for _ in range(L)]
    v = [[torch.randn(s + n, KV_HEADS, D, generator=gen) for s, n in spans] for _ in range(L)]

    def tables(copies: int) -> list[list[list[int]]]:
        """`copies` tables per row over shuffled page ids, 5 pages spare."""
        ids = list(range(copies * sum(nblocks) + 5))
        order.shuffle(ids)
        out = []
        for _ in range(copies):
            out.append([])
            for nb in nblocks:
                out[-1].append(ids[:nb])
                ids = ids[nb:]
        return out

    # One group: a block holds every layer.
    (flat,) = tables(1)
    ref = pool(L, sum(nblocks) + 5, gen)
    # Grouped: a global table, and a table per local sub-group whose pages behind the
    # window are freed (−1); their would-be pages, the spare ones and the unused slot of
    # the padded sub-group all hold NaN, so reading any of them poisons the output.
    subs = GROUPS.pages_per_local_block
    assert (GROUPS.page_layers, subs) == (3, 2)
    npages = sum(nblocks) * (1 + subs)
    glob, *local = tables(1 + subs)
    grouped = pool(GROUPS.page_layers, npages + 5, gen)
    for layer in range(L):
        table, slot = GROUPS.place(layer)
        for i, (s, _) in enumerate(spans):
            before = range(s)
            ref.write(layer, slots_of(flat[i], before), k[layer][i][:s], v[layer][i][:s])
            tb = glob[i] if table == -1 else local[table][i]
            grouped.write(slot, slots_of(tb, before), k[layer][i][:s], v[layer][i][:s])
    used = {p for tbs in (glob, *local) for tb in tbs for p in tb}
    freed: list[int] = []
    for tbs in local:
        for i, (s, _) in enumerate(spans):
            first = GROUPS.first_live_block(s, P)
            freed += tbs[i][:first]
            tbs[i][:first] = [-1] * first
    spare = sorted(set(range(npages + 5)) - used)
    poison(grouped, range(GROUPS.page_layers), freed + spare)
    filled = len(GROUPS.local_layers) - (subs - 1) * GROUPS.page_layers  # the last sub-group's
    poison(grouped, range(filled, GROUPS.page_layers), [p for tb in local[-1] for p in tb
                                                         if p >= 0])

    rows = [BatchRow([0] * n, s, flat[i]) for i, (s, n) in enumerate(spans)]
    grows = [BatchRow([0] * n, s, glob[i], window_tables=[tbs[i] for tbs in local])
             for i, (s, n) in enumerate(spans)]
    one = PagedBatch.from_rows(rows, P, {None, W}, CPU)
    two = PagedBatch.from_rows(grows, P, {None, W}, CPU, GROUPS)
    assert one.num_context_tokens == two.num_context_tokens == sum(s + n for s, n in spans)
    assert two.num_window_tokens == sum(s + n - max(0, s - W + 1) for s, n in spans)
    total = sum(n for _, n in spans)
    for layer in range(L):
        q = torch.randn(total, HEADS, D, generator=gen)
        new_k = torch.cat([k[layer][i][s:] for i, (s, _) in enumerate(spans)])
        new_v = torch.cat([v[layer][i][s:] for i, (s, _) in enumerate(spans)])
        want = paged_attention(ref, one, layer, window(layer), SCALE, q, new_k, new_v)
        got = paged_attention(grouped, two, layer, window(layer), SCALE, q, new_k, new_v)
        assert not got.isnan().any(), f"layer {layer} read a freed, spare or unused slot"
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"layer {layer}"


def test_window_tables_read_only_the_window() -> None:
    # Decode rows far past the window (freed blocks), near it, and inside it, padded to one
    # width; prefill chunks starting past the window, at 0, and straddling it.
    spans = [(29, 1), (17, 1), (3, 1), (5, 1), (20, 7), (0, 10), (9, 3), (14, 9)]
    assert any(GROUPS.first_live_block(s, P) > 1 for s, n in spans if n == 1)
    assert any(GROUPS.first_live_block(s, P) > 1 for s, n in spans if n > 1)
    run(spans)


@pytest.mark.parametrize("spans", [[(3, 1), (0, 1), (6, 1), (0, 5), (2, 4)], [(7, 1)]])
def test_window_covering_the_context_reads_everything(spans) -> None:
    assert all(GROUPS.first_live_block(s, P) == 0 for s, _ in spans)
    run(spans, seed=1)


def test_a_row_without_window_tables_is_refused() -> None:
    with pytest.raises(AssertionError, match="without its window tables"):
        PagedBatch.from_rows([BatchRow([1], 3, [0])], P, {None, W}, CPU, GROUPS)


def test_executors_that_cannot_free_window_kv_say_why(tiny_llama) -> None:
    from kvdeck.runtime.errors import ConfigError
    from kvdeck.runtime.executors.base import WindowGroups, capability
    from kvdeck.runtime.executors.sim import SimExecutor
    from kvdeck.runtime.executors.torch import TorchExecutor

    with pytest.raises(ConfigError, match="^free_window_kv needs an executor that lays out KV "
                                          "pages of its own .* the sim executor does not"):
        capability(SimExecutor(), WindowGroups, "free_window_kv")
    with pytest.raises(ConfigError, match="tiny-llama attends over the whole context"):
        TorchExecutor(tiny_llama, device="cpu").layer_groups()
