"""Attention over block tables with holes (token-level eviction, `kv/eviction.py`): every row
attends over exactly the keys its kept blocks hold, at their own positions; an evicted
block's page is never read (it holds NaN here); and the attention reported per block
(heavy-hitter's ranking) is the softmax mass on that block's keys."""

from __future__ import annotations

import torch

from kvdeck.runtime.executors.kv_codecs import get_codec
from kvdeck.runtime.executors.paged_kv import BatchRow, PagedBatch, PagedKVCache, paged_attention

CPU = torch.device("cpu")
P, HEADS, KV_HEADS, D = 4, 4, 2, 8
SCALE = D ** -0.5


def test_rows_read_only_their_kept_blocks_and_report_the_mass_on_each() -> None:
    gen = torch.Generator().manual_seed(0)
    kv = PagedKVCache(1, 16, P, KV_HEADS, D, get_codec("fp32", D, CPU), CPU)
    for part in (kv.k[0][0], kv.v[0][0]):
        part.copy_(torch.randn(part.shape, generator=gen))
    # A decode row at position 21 (blocks 0..5, blocks 2 and 3 evicted) and a prefill
    # chunk of 5 tokens at positions 14..18 (blocks 0..4, block 1 evicted).
    decode = BatchRow([7], 21, [3, 9, -1, -1, 12, 1])
    chunk = BatchRow([1, 2, 3, 4, 5], 14, [8, -1, 0, 5, 11])
    for page in (2, 4, 6, 7, 10, 13, 14, 15):  # every page no table names
        kv.k[0][0][page] = float("nan")
        kv.v[0][0][page] = float("nan")
    batch = PagedBatch.from_rows([decode, chunk], P, {None}, CPU, holes=True, scores=True)
    q = torch.randn(6, HEADS, D, generator=gen)
    k_new = torch.randn(6, KV_HEADS, D, generator=gen)
    v_new = torch.randn(6, KV_HEADS, D, generator=gen)
    out = paged_attention(kv, batch, 0, None, SCALE, q, k_new, v_new)
    assert torch.isfinite(out).all()

    def expected(row: BatchRow, queries: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        kept = [(k, b) for k, b in enumerate(row.table) if b >= 0]
        pos = torch.tensor([k * P + j for k, _ in kept for j in range(P)])
        keys = torch.cat([kv.k[0][0][b] for _, b in kept])      # after this step's writes
        vals = torch.cat([kv.v[0][0][b] for _, b in kept])
        qpos = torch.arange(row.start, row.start + len(row.tokens))
        mask = (pos[None, :] <= qpos[:, None])
        rep = HEADS // KV_HEADS
        kh = keys.repeat_interleave(rep, 1).transpose(0, 1)      # [H, L, d]
        vh = vals.repeat_interleave(rep, 1).transpose(0, 1)
        w = ((queries.transpose(0, 1) @ kh.transpose(1, 2)) * SCALE
             ).masked_fill(~mask, float("-inf")).softmax(-1)      # [H, n, L]
        mass = w.sum((0, 1)).view(-1, P).sum(-1)
        per_block = [0.0] * len(row.table)
        for (k, _), m in zip(kept, mass.tolist(), strict=True):
            per_block[k] = m
        return (w @ vh).transpose(0, 1), per_block

    want_decode, mass_decode = expected(decode, q[:1])
    want_chunk, mass_chunk = expected(chunk, q[1:])
    torch.testing.assert_close(out[:1], want_decode, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1:], want_chunk, rtol=1e-5, atol=1e-5)
    got = batch.attention(["decode", "chunk"])
    torch.testing.assert_close(torch.tensor(got["decode"]), torch.tensor(mass_decode))
    torch.testing.assert_close(torch.tensor(got["chunk"]), torch.tensor(mass_chunk))
    # Every query's weights sum to one per head; evicted blocks drew nothing.
    assert abs(sum(got["decode"]) - HEADS) < 1e-4 and abs(sum(got["chunk"]) - 5 * HEADS) < 1e-4
    assert got["decode"][2] == got["decode"][3] == got["chunk"][1] == 0.0
    # Only kept keys are counted as read.
    assert batch.num_context_tokens == (22 - 2 * P) + (19 - P)


def test_a_table_without_holes_reads_as_before() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = PagedKVCache(1, 8, P, KV_HEADS, D, get_codec("fp32", D, CPU), CPU)
    for part in (kv.k[0][0], kv.v[0][0]):
        part.copy_(torch.randn(part.shape, generator=gen))
    rows = [BatchRow([7], 9, [4, 1, 6]), BatchRow([1, 2, 3], 2, [0, 5])]
    q = torch.randn(4, HEADS, D, generator=gen)
    k_new = torch.randn(4, KV_HEADS, D, generator=gen)
    v_new = torch.randn(4, KV_HEADS, D, generator=gen)
    outs = []
    for holes in (False, True):
        batch = PagedBatch.from_rows(rows, P, {None}, CPU, holes=holes)
        outs.append(paged_attention(kv, batch, 0, None, SCALE, q, k_new, v_new))
    torch.testing.assert_close(outs[0], outs[1])
