"""Physical paged KV: per-layer K and V tensors `[num_blocks, block_size, kv_heads, head_dim]`
addressed only through the block tables the engine's KV manager hands out, and attention
over them for a mixed batch of decode rows and prefill chunks.

Per step, `PagedBatch.build` turns a plan into index tensors once; every layer then
(1) writes the new K/V into the slots the tables name, (2) runs one batched attention for all
decode rows (keys gathered through a padded `[B, max_blocks]` block index, masked to each
row's length) and (3) one attention per prefill chunk (causal within the chunk, full over
its cached prefix). Sliding-window layers mask keys outside their window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.executors.kv_codecs import KVCodec
from runtime.plan import SchedulerOutput


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Float8 storage as bytes: CPU torch has no index_copy/index_select for float8."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class PagedKVCache:
    """The block pool's bytes: K and V per layer, each stored as its format's parts (see
    `kv_codecs.py`), every part shaped `[num_blocks, block_size, kv_heads, ...]`."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, codec: KVCodec, device: torch.device, pin: bool = False):
        """`pin`: page-locked host memory (a host tier beside a CUDA pool: its copies then
        run at the link's full speed)."""
        self.codec = codec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.head_dim = head_dim

        def parts() -> list[torch.Tensor]:
            return [torch.zeros((num_blocks, block_size, num_kv_heads, *shape), dtype=dtype,
                                device=device, pin_memory=pin)
                    for shape, dtype in codec.part_shapes(head_dim)]

        self.k = [parts() for _ in range(num_layers)]
        self.v = [parts() for _ in range(num_layers)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.k + self.v for t in layer)

    @property
    def bytes_per_block(self) -> int:
        return self.num_bytes // self.num_blocks

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's contents into block dst, in every layer."""
        if not pairs:
            return
        dev = self.k[0][0].device
        src = torch.tensor([s for s, _ in pairs], device=dev)
        dst = torch.tensor([d for _, d in pairs], device=dev)
        for layer in self.k + self.v:
            for t in layer:
                raw = _raw(t)
                raw[dst] = raw[src]

    def copy_to(self, other: PagedKVCache, pairs: list[list[int]]) -> int:
        """Copy block `src` of this pool into block `dst` of `other` (same format and shape,
        another device: a swap or a demotion out, a swap-in or promotion back) for each
        [src, dst]; returns the bytes copied. One gather and one scatter per tensor."""
        if not pairs:
            return 0
        src_dev, dst_dev = self.k[0][0].device, other.k[0][0].device
        src = torch.tensor([p[0] for p in pairs], device=src_dev)
        dst = torch.tensor([p[1] for p in pairs], device=dst_dev)
        nbytes = 0
        for mine, theirs in zip(self.k + self.v, other.k + other.v, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                rows = _raw(a).index_select(0, src)
                rows = rows.to(dst_dev)  # blocking: the scatter below reads it at once
                _raw(b).index_copy_(0, dst, rows)
                nbytes += rows.numel() * rows.element_size()
        return nbytes

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode this step's K/V rows `[T, kv_heads, d]` into the token slots named."""
        for stored, x in ((self.k[layer], k), (self.v[layer], v)):
            for t, part in zip(stored, self.codec.encode(x), strict=True):
                _raw(t).view(-1, *t.shape[2:]).index_copy_(0, slots, _raw(part))

    def gather(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V for block indices `[..., nb]` as `[..., nb * block_size, kv_heads, d]` in
        `dtype`: the stored parts are read, then decoded once."""
        return (self._read(self.k[layer], blocks, dtype),
                self._read(self.v[layer], blocks, dtype))

    def _read(self, stored: list[torch.Tensor], blocks: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
        # index_select on a 2-D view: several times cheaper than advanced indexing here.
        flat = blocks.reshape(-1)
        lead = (*blocks.shape[:-1], blocks.shape[-1] * self.block_size)
        parts = [_raw(t).view(t.shape[0], -1).index_select(0, flat)
                 .view(*lead, *t.shape[2:]).view(t.dtype) for t in stored]
        return self.codec.decode(parts, dtype)

    def convert(self, codec: KVCodec, num_blocks: int, src: list[int], dst: list[int],
                batch_blocks: int = 1024) -> PagedKVCache:
        """A new pool of `num_blocks` blocks in `codec`'s format holding, at each `dst`
        block, the contents of the matching `src` block of this pool (decoded to float32
        and re-encoded; layer by layer, `batch_blocks` blocks at a time so the float copy
        stays small)."""
        device = self.k[0][0].device
        num_kv_heads = self.k[0][0].shape[2]
        new = PagedKVCache(self.num_layers, num_blocks, self.block_size, num_kv_heads,
                           self.head_dim, codec, device)
        if codec.name == self.codec.name:  # the same format re-laid: bytes move as they are
            for i in range(0, len(src), batch_blocks):
                self.copy_to(new, [[a, b] for a, b in zip(src[i:i + batch_blocks],
                                                          dst[i:i + batch_blocks],
                                                          strict=True)])
            return new
        for i in range(0, len(src), batch_blocks):
            s = torch.tensor(src[i:i + batch_blocks], dtype=torch.long, device=device)
            d = torch.tensor(dst[i:i + batch_blocks], dtype=torch.long, device=device)
            for old_layers, new_layers in ((self.k, new.k), (self.v, new.v)):
                for old, fresh in zip(old_layers, new_layers, strict=True):
                    values = self.codec.decode([_raw(t)[s].view(t.dtype) for t in old],
                                               torch.float32)
                    for t, part in zip(fresh, codec.encode(values), strict=True):
                        _raw(t)[d] = _raw(part)
        return new


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, length: torch.Tensor,
                 window: int | None) -> torch.Tensor:
    """Allowed (query, key) pairs: causal, within length, and within the window if any."""
    allowed = (key_pos <= query_pos) & (key_pos < length)
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed


@dataclass
class PrefillChunk:
    row: int
    num_new: int
    start: int
    blocks: torch.Tensor
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class BatchRow:
    """One sequence's rows in a step: `tokens` at positions `start, start + 1, …` of the
    sequence whose block table is `table`."""

    tokens: list[int]
    start: int
    table: list[int]
    sample_id: str | None = None
    """Sample at the last row, reported under this id (None: no sample)."""
    verify: bool = False
    """Every row is scored (a speculating chunk: `PagedBatch.verify`)."""


@dataclass
class PagedBatch:
    """Index tensors for one step, built once and used by every layer."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    sample_rows: torch.Tensor
    sample_ids: list[str]
    verify: list[tuple[int, int]] = field(default_factory=list)
    """(chunk index, first row) of each speculating chunk: its `1 + len(draft)` rows are
    all scored (`runtime/spec/verify.py`)."""
    decode_rows: torch.Tensor | None = None
    decode_blocks: torch.Tensor | None = None
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_context_tokens: int = 0

    @classmethod
    def build(cls, plan: SchedulerOutput, block_size: int, windows: set[int | None],
              device: torch.device) -> PagedBatch:
        """The batch for a plan: each chunk's tokens from its request, a speculating chunk's
        last known token followed by its draft."""
        rows = []
        for c in plan.chunks:
            req, start, n = c.request, c.start, c.num_new_tokens
            if c.num_draft:  # the last known token, then the draft: a causal chunk of 1 + k
                assert len(c.draft) == c.num_draft, "a speculating chunk reached the " \
                    "executor without its draft"
                toks = [*req.token_slice(start, start + 1), *c.draft]
                rows.append(BatchRow(toks, start, c.block_table, None, True))
            else:
                rows.append(BatchRow(req.token_slice(start, start + n), start, c.block_table,
                                     c.request_id if c.sample else None))
        return cls.from_rows(rows, block_size, windows, device)

    @classmethod
    def from_rows(cls, batch_rows: list[BatchRow], block_size: int, windows: set[int | None],
                  device: torch.device) -> PagedBatch:
        """The batch for explicit rows (a draft model's passes use this directly)."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_pos: list[int] = []
        prefills: list[PrefillChunk] = []
        verify: list[tuple[int, int]] = []
        context = 0
        p = block_size
        for index, r in enumerate(batch_rows):
            row = len(tokens)
            table, start, n = r.table, r.start, len(r.tokens)
            tokens.extend(r.tokens)
            if r.verify:
                verify.append((index, row))
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // p] * p + pos % p)
            context += start + n
            if r.sample_id is not None:
                sample_rows.append(row + n - 1)
                sample_ids.append(r.sample_id)
            nb = -(-(start + n) // p)
            if n == 1:
                dec_rows.append(row)
                dec_tables.append(table[:nb])
                dec_pos.append(start)
            else:
                prefills.append(PrefillChunk(row, n, start,
                                             torch.tensor(table[:nb], device=device)))

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        batch = cls(t(tokens), t(positions), t(slots), t(sample_rows), sample_ids,
                    verify=verify, prefills=prefills, num_context_tokens=context)
        if dec_rows:
            width = max(len(tb) for tb in dec_tables)
            padded = [tb + [tb[0]] * (width - len(tb)) for tb in dec_tables]
            batch.decode_rows = t(dec_rows)
            batch.decode_blocks = t(padded)
            qpos = t(dec_pos)[:, None]
            kpos = torch.arange(width * p, device=device)[None, :]
            for w in windows:
                batch.decode_masks[w] = _window_mask(qpos, kpos, qpos + 1, w)[:, None, None, :]
        for ch in prefills:
            qpos = torch.arange(ch.start, ch.start + ch.num_new, device=device)[:, None]
            kpos = torch.arange(len(ch.blocks) * p, device=device)[None, :]
            for w in windows:
                ch.masks[w] = _window_mask(qpos, kpos, qpos.new_tensor(ch.start + ch.num_new),
                                           w)
        return batch


def paged_attention(kv: PagedKVCache, batch: PagedBatch, layer: int, window: int | None,
                    scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                    ) -> torch.Tensor:
    """Write this step's K/V into their slots, then attend every row over its context."""
    kv.write(layer, batch.slots, k, v)
    out = torch.empty_like(q)
    if batch.decode_rows is not None:
        keys, values = kv.gather(layer, batch.decode_blocks, q.dtype)  # [B, L, KVH, d]
        qd = q[batch.decode_rows].unsqueeze(2)                         # [B, H, 1, d]
        o = F.scaled_dot_product_attention(
            qd, keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=batch.decode_masks[window], scale=scale, enable_gqa=True)
        out[batch.decode_rows] = o.squeeze(2)
    for ch in batch.prefills:
        keys, values = kv.gather(layer, ch.blocks, q.dtype)          # [L, KVH, d]
        qc = q[ch.row:ch.row + ch.num_new].transpose(0, 1)[None]      # [1, H, n, d]
        o = F.scaled_dot_product_attention(
            qc, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=ch.masks[window], scale=scale, enable_gqa=True)
        out[ch.row:ch.row + ch.num_new] = o[0].transpose(0, 1)
    return out
