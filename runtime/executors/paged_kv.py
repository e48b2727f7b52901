"""Physical paged KV: per-layer K and V tensors `[num_blocks, block_size, kv_heads, head_dim]`
addressed only through the block tables the engine's KV manager hands out, and attention
over them for a mixed batch of decode rows and prefill chunks.

Per step, `PagedBatch.build` turns a plan into index tensors once; every layer then
(1) writes the new K/V into the slots the tables name, (2) runs one batched attention for all
decode rows (keys gathered through a padded `[B, max_blocks]` block index, masked to each
row's length) and (3) one attention per prefill chunk (causal within the chunk, full over
its cached prefix). Sliding-window layers mask keys outside their window.

With layer groups (`kv/groups.py`, `free_window_kv`) the pool holds pages of a few layers'
slots, and the index tensors are built once per table — the global table and each local
sub-group's — with a layer writing and reading its own slot through its table. A local
table is read only from the first block its rows' windows reach: the blocks before it may
have been freed.

Under token-level eviction (`kv/eviction.py`) a table has holes (−1) where blocks were
evicted: a row reads the blocks left, each key at its own position. With `scores` the
attention every row puts on each block it reads is summed over heads, rows and layers
(`PagedBatch.block_scores`: what heavy-hitter eviction ranks blocks by).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvdeck.runtime.core.step_data import SchedulerOutput
from kvdeck.runtime.executors.kv_codecs import KVCodec
from kvdeck.runtime.kv.groups import LayerGroups


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Float8 storage as bytes: CPU torch has no index_copy/index_select for float8."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class PagedKVCache:
    """The block pool's bytes: K and V per layer, each stored as its format's parts (see
    `kv_codecs.py`), every part shaped `[num_blocks, block_size, kv_heads, ...]`."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, codec: KVCodec, device: torch.device, pin: bool = False,
                 spare: int = 0):
        """`pin`: page-locked host memory (a host tier beside a CUDA pool: its copies then
        run at the link's full speed). `spare`: blocks past `num_blocks` that no table
        names, which CUDA graphs' padding rows write into (`torch_graphs.py`)."""
        self.codec = codec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.spare = spare
        self.num_layers = num_layers
        self.head_dim = head_dim

        def parts() -> list[torch.Tensor]:
            return [torch.zeros((num_blocks + spare, block_size, num_kv_heads, *shape),
                                dtype=dtype,
                                device=device, pin_memory=pin)
                    for shape, dtype in codec.part_shapes(head_dim)]

        self.k = [parts() for _ in range(num_layers)]
        self.v = [parts() for _ in range(num_layers)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.k + self.v for t in layer)

    @property
    def bytes_per_block(self) -> int:
        return self.num_bytes // (self.num_blocks + self.spare)

    @property
    def spare_block(self) -> int:
        """The first spare block's id (see `spare`)."""
        assert self.spare, "a pool without spare blocks"
        return self.num_blocks

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
                           self.head_dim, codec, device, spare=self.spare)
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
    """A chunk of more than one row: rows `row … row + num_new − 1` of the batch, at
    positions `start, start + 1, …`."""

    row: int
    num_new: int
    start: int


@dataclass
class TableIndex:
    """One block table's index tensors for a step, used by every layer that reads through
    that table: the slot each new token's K/V is written to, the blocks each decode row and
    prefill chunk reads and the masks over those blocks' keys (by window)."""

    slots: torch.Tensor
    decode_blocks: torch.Tensor | None
    decode_masks: dict[int | None, torch.Tensor]
    prefill_blocks: list[torch.Tensor]
    prefill_masks: list[dict[int | None, torch.Tensor]]


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
    window_tables: list[list[int]] | None = None
    """With layer groups: each local sub-group's page table (`ScheduledChunk.window_tables`);
    `table` then holds the global layers' pages."""


_PAST = 1 << 40
"""The key position of a padding slot: past every row's length, so masked."""


class _Reach:
    """Which blocks of its table each row of a batch reads — from its `first` block to the
    one holding its last token, less the holes when `holes` — and the masks over those
    keys. The masks depend only on the rows, not on the table, so the local sub-groups'
    tables share one reach."""

    def __init__(self, rows: list[BatchRow], firsts: list[int], block_size: int,
                 windows: set[int | None], device: torch.device, holes: bool = False):
        p = block_size
        self.rows, self.firsts, self.block_size, self.device = rows, firsts, p, device
        self.ends = [-(-(r.start + len(r.tokens)) // p) for r in rows]
        self.decode = [i for i, r in enumerate(rows) if len(r.tokens) == 1]
        self.prefill = [i for i, r in enumerate(rows) if len(r.tokens) > 1]
        self.reads = [[k for k in range(f, e) if r.table[k] >= 0] for r, f, e in
                      zip(rows, firsts, self.ends, strict=True)] if holes else None
        """Per row, the table indices it reads (None: every one from `first` to its end)."""
        self.width = max((self.ends[i] - firsts[i] for i in self.decode), default=0) \
            if self.reads is None else max((len(self.reads[i]) for i in self.decode), default=0)
        self.decode_masks: dict[int | None, torch.Tensor] = {}
        if self.decode:
            qpos = self._t([rows[i].start for i in self.decode])[:, None]
            if self.reads is not None:  # the positions of the blocks left, then padding
                kpos = self._t([pos for i in self.decode for pos in self._positions(i, True)]
                               ).view(len(self.decode), -1)
            else:
                kpos = torch.arange(self.width * p, device=device)[None, :]
                if any(firsts[i] for i in self.decode):  # per row: [B, width·p]
                    kpos = self._t([firsts[i] * p for i in self.decode])[:, None] + kpos
            for w in windows:
                self.decode_masks[w] = _window_mask(qpos, kpos, qpos + 1, w)[:, None, None, :]
        self.prefill_masks: list[dict[int | None, torch.Tensor]] = []
        for i in self.prefill:
            start, n = rows[i].start, len(rows[i].tokens)
            qpos = torch.arange(start, start + n, device=device)[:, None]
            kpos = self._t(self._positions(i, False))[None, :] if self.reads is not None \
                else torch.arange(firsts[i] * p, self.ends[i] * p, device=device)[None, :]
            self.prefill_masks.append({w: _window_mask(qpos, kpos, qpos.new_tensor(start + n), w)
                                       for w in windows})

    def _positions(self, i: int, pad: bool) -> list[int]:
        """The key positions row `i` reads (with `pad`, padded to the decode width)."""
        p = self.block_size
        out = [k * p + j for k in self.reads[i] for j in range(p)]
        return out + [_PAST] * (self.width * p - len(out)) if pad else out

    def blocks_read(self, i: int) -> list[int]:
        """The table indices row `i` reads, in order."""
        return self.reads[i] if self.reads is not None else \
            list(range(self.firsts[i], self.ends[i]))

    def _t(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def index(self, tables: list[list[int]]) -> TableIndex:
        """The index tensors of one table per row (entries before a row's `first` block
        are never read: freed pages are −1 there)."""
        p, firsts, ends = self.block_size, self.firsts, self.ends
        slots = [tb[pos // p] * p + pos % p for tb, r in zip(tables, self.rows, strict=True)
                 for pos in range(r.start, r.start + len(r.tokens))]
        reads = self.reads
        # A slot in a hole would be a negative index, wrapping to another block's bytes.
        assert reads is None or min(slots, default=0) >= 0, "a row writes into an evicted block"

        def read(i: int) -> list[int]:
            return tables[i][firsts[i]:ends[i]] if reads is None else \
                [tables[i][k] for k in reads[i]]

        decode_blocks = None
        if self.decode:
            # Pad with the row's own first block: a valid page, hidden by the mask.
            decode_blocks = self._t([(b := read(i)) + [b[0]] * (self.width - len(b))
                                     for i in self.decode])
        prefill_blocks = [self._t(read(i)) for i in self.prefill]
        return TableIndex(self._t(slots), decode_blocks, self.decode_masks, prefill_blocks,
                          self.prefill_masks)


@dataclass
class PagedBatch:
    """Index tensors for one step, built once and used by every layer."""

    tokens: torch.Tensor
    positions: torch.Tensor
    sample_rows: torch.Tensor
    sample_ids: list[str]
    verify: list[tuple[int, int]] = field(default_factory=list)
    """(chunk index, first row) of each speculating chunk: its `1 + len(draft)` rows are
    all scored (`runtime/spec/verify.py`)."""
    decode_rows: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    tables: dict[int, TableIndex] = field(default_factory=dict)
    """Index tensors per table: −1 the rows' `table` (every layer's without groups, the
    global layers' with them), t ≥ 0 local sub-group t's (`LayerGroups.place`)."""
    groups: LayerGroups | None = None
    num_context_tokens: int = 0
    """Keys the rows attend over in a full-attention layer, summed over rows."""
    num_window_tokens: int = 0
    """Keys the rows attend over in a sliding-window layer (with groups; else 0)."""
    scored: _Reach | None = None
    """With `scores`: the rows' reach; `decode_mass` and `prefill_mass` then sum the
    attention on each block read (`block_scores`)."""
    decode_mass: torch.Tensor | None = None
    prefill_mass: list[torch.Tensor] = field(default_factory=list)

    def attention(self, ids: list[str]) -> dict[str, list[float]]:
        """Row id -> `block_scores` of that row, for rows named by `ids` in batch order;
        empty without `scores`."""
        if self.scored is None:
            return {}
        return dict(zip(ids, self.block_scores(), strict=True))

    def block_scores(self) -> list[list[float]]:
        """Per row, the attention it put on each block of its table (0 where it read none),
        summed over heads, query rows and layers: `scores` asked for it."""
        reach = self.scored
        assert reach is not None, "block_scores without scores"
        out = [[0.0] * end for end in reach.ends]
        masses = ([] if self.decode_mass is None else self.decode_mass.tolist()) + \
            [m.tolist() for m in self.prefill_mass]
        for i, mass in zip(reach.decode + reach.prefill, masses, strict=True):
            for k, m in zip(reach.blocks_read(i), mass, strict=False):  # decode: padded
                out[i][k] = m
        return out

    @classmethod
    def build(cls, plan: SchedulerOutput, block_size: int, windows: set[int | None],
              device: torch.device, groups: LayerGroups | None = None, holes: bool = False,
              scores: bool = False) -> PagedBatch:
        """The batch for a plan: each chunk's tokens from its request, a speculating chunk's
        last known token followed by its draft."""
        rows = []
        for c in plan.chunks:
            req, start, n = c.request, c.start, c.num_new_tokens
            if c.num_draft:  # the last known token, then the draft: a causal chunk of 1 + k
                assert len(c.draft) == c.num_draft, "a speculating chunk reached the " \
                    "executor without its draft"
                toks = [*req.token_slice(start, start + 1), *c.draft]
                rows.append(BatchRow(toks, start, c.block_table, None, True, c.window_tables))
            else:
                rows.append(BatchRow(req.token_slice(start, start + n), start, c.block_table,
                                     c.request_id if c.sample else None, False,
                                     c.window_tables))
        return cls.from_rows(rows, block_size, windows, device, groups, holes, scores)

    @classmethod
    def from_rows(cls, batch_rows: list[BatchRow], block_size: int, windows: set[int | None],
                  device: torch.device, groups: LayerGroups | None = None,
                  holes: bool = False, scores: bool = False) -> PagedBatch:
        """The batch for explicit rows (a draft model's passes use this directly). With
        `groups`, `windows` is unused: global tables take no window, local ones the
        groups' window, and every row must carry its `window_tables`."""
        tokens: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        dec_rows: list[int] = []
        prefills: list[PrefillChunk] = []
        verify: list[tuple[int, int]] = []
        context = 0
        for index, r in enumerate(batch_rows):
            row = len(tokens)
            start, n = r.start, len(r.tokens)
            tokens.extend(r.tokens)
            positions.extend(range(start, start + n))
            if r.verify:
                verify.append((index, row))
            context += start + n
            if r.sample_id is not None:
                sample_rows.append(row + n - 1)
                sample_ids.append(r.sample_id)
            if n == 1:
                dec_rows.append(row)
            else:
                prefills.append(PrefillChunk(row, n, start))

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        batch = cls(t(tokens), t(positions), t(sample_rows), sample_ids, verify=verify,
                    decode_rows=t(dec_rows) if dec_rows else None, prefills=prefills,
                    groups=groups, num_context_tokens=context)
        zeros = [0] * len(batch_rows)
        tables = [r.table for r in batch_rows]
        if groups is None:
            reach = _Reach(batch_rows, zeros, block_size, windows, device, holes)
            batch.tables[-1] = reach.index(tables)
            if holes:  # evicted keys are not read
                batch.num_context_tokens -= block_size * sum(
                    e - len(r) for e, r in zip(reach.ends, reach.reads, strict=True))
            if scores:
                batch.scored = reach
                batch.decode_mass = torch.zeros(len(reach.decode), reach.width, device=device) \
                    if reach.decode else None
                batch.prefill_mass = [torch.zeros(len(reach.blocks_read(i)), device=device)
                                      for i in reach.prefill]
            return batch
        assert all(r.window_tables is not None
                   and len(r.window_tables) == groups.pages_per_local_block
                   for r in batch_rows), "a row reached a grouped pool without its window tables"
        batch.tables[-1] = _Reach(batch_rows, zeros, block_size, {None}, device).index(tables)
        # A local layer's query at q reads keys from q − w + 1: blocks wholly before the
        # first query's window are skipped (and may be freed).
        firsts = [groups.first_live_block(r.start, block_size) for r in batch_rows]
        local = _Reach(batch_rows, firsts, block_size, {groups.window}, device)
        for sub in range(groups.pages_per_local_block):
            batch.tables[sub] = local.index([r.window_tables[sub] for r in batch_rows])
        batch.num_window_tokens = sum(
            r.start + len(r.tokens) - max(0, r.start - groups.window + 1) for r in batch_rows)
        return batch


def paged_attention(kv: PagedKVCache, batch: PagedBatch, layer: int, window: int | None,
                    scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                    ) -> torch.Tensor:
    """Write this step's K/V into their slots, then attend every row over its context. With
    layer groups the layer's K/V live in one slot of its table's pages (`groups.place`)."""
    table, slot = (-1, layer) if batch.groups is None else batch.groups.place(layer)
    ix = batch.tables[table]
    kv.write(slot, ix.slots, k, v)
    out = torch.empty_like(q)
    if batch.decode_rows is not None:
        keys, values = kv.gather(slot, ix.decode_blocks, q.dtype)      # [B, L, KVH, d]
        qd = q[batch.decode_rows].unsqueeze(2)                         # [B, H, 1, d]
        o = F.scaled_dot_product_attention(
            qd, keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=ix.decode_masks[window], scale=scale, enable_gqa=True)
        out[batch.decode_rows] = o.squeeze(2)
        if batch.decode_mass is not None and table == -1:
            batch.decode_mass += _mass(qd, keys.transpose(1, 2), ix.decode_masks[window], scale
                                       ).view(len(qd), -1, kv.block_size).sum(-1)
    for j, (ch, blocks, masks) in enumerate(zip(batch.prefills, ix.prefill_blocks,
                                                ix.prefill_masks, strict=True)):
        keys, values = kv.gather(slot, blocks, q.dtype)               # [L, KVH, d]
        qc = q[ch.row:ch.row + ch.num_new].transpose(0, 1)[None]      # [1, H, n, d]
        o = F.scaled_dot_product_attention(
            qc, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=masks[window], scale=scale, enable_gqa=True)
        out[ch.row:ch.row + ch.num_new] = o[0].transpose(0, 1)
        if batch.scored is not None and table == -1:
            batch.prefill_mass[j] += _mass(qc, keys.transpose(0, 1)[None], masks[window],
                                           scale).view(-1, kv.block_size).sum(-1)
    return out


def _mass(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float
          ) -> torch.Tensor:
    """Attention weights `[B, H, n, L]` (queries `q`, keys `[B, KVH, L, d]` shared by
    query-head groups, `mask` broadcast as for the attention itself) summed over heads and
    queries: `[B, L]`, the attention mass on each key."""
    keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale
    return logits.masked_fill(~mask, float("-inf")).softmax(-1).sum((1, 2))
