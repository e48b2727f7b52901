"""GGML's block formats of the quantized GGUFs kvdeck ships, dequantized with torch.

`gguf.quants` decodes every type in numpy on one core, one group of rows at a time (what
that costs a load, measured: docs/executors.md, "Loading"). These decode whole chunks of
blocks in torch's threaded element-wise ops, doing the same arithmetic in the same order
as `gguf.quants` (whose outputs the unit tests hold them to, bit for bit), in place after
the first float32 buffer: a fresh buffer per operation cost as much again in page faults.
A type not here goes to `gguf.quants`.

Each decoder takes blocks as uint8 [n, bytes per block] and returns float32
[n, elements per block]. The layouts follow ggml's `block_q4_0`, `block_q5_0`,
`block_q4_K` and `block_q6_K`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
QK_K = 256
"""Elements of a k-quant super-block."""


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row as one float16 each, in float32: [n, 2] -> [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes [n, k * group] as 4-bit values [n, k, 2, group]: for each group of bytes, the
    low nibbles first, then the high ones (ggml's order in every 4-bit format)."""
    b = b.reshape(b.shape[0], -1, 1, group)
    return torch.cat([b & 0x0F, b >> 4], dim=2)


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """32 elements: a float16 scale, 16 bytes of 4-bit values; x = (q - 8) * d."""
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:], 16).reshape(blocks.shape[0], 32).to(torch.int8) - 8
    return q.float().mul_(d)


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """32 elements: a float16 scale, 32 high bits (bit i for element i, little-endian),
    16 bytes of low nibbles; x = (q - 16) * d."""
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    # Bit by bit from the bytes: a view as int32 would need the bits 4-byte aligned, which a
    # lone 22-byte block is not.
    shifts = torch.arange(8, dtype=torch.uint8)
    qh = ((blocks[:, 2:6, None] >> shifts) & 1).reshape(n, 32)
    ql = _nibbles(blocks[:, 6:], 16).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return q.float().mul_(d)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in a k-quant's 12 bytes."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """256 elements in 8 sub-blocks of 32: float16 d and dmin, 12 bytes of six-bit scales
    and mins, 128 bytes of 4-bit values; x = d * scale * q - dmin * min."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, -1, 1)
    low = (dmin * mn.float()).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, -1, 32)
    return q.float().mul_(scale).sub_(low).reshape(n, QK_K)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """256 elements in 16 sub-blocks of 16: 128 bytes of low nibbles, 64 of high bit pairs,
    16 int8 scales, a float16 d; x = d * scale * (q - 32)."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks[:, 208:210])
    scale = (d * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    pairs = qh.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(
        1, 1, 4, 1)
    high = (pairs & 0x03).reshape(n, -1, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return q.reshape(n, QK_K // 16, -1).float().mul_(scale).reshape(n, QK_K)


DECODERS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: q4_0, Q.Q5_0: q5_0, Q.Q4_K: q4_k, Q.Q6_K: q6_k}
"""The block types decoded here, by GGML type."""
