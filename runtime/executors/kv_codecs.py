"""Encoding and decoding KV values in each storage format, vectorized in torch.

A codec turns float rows `[..., head_dim]` into the tensors a block pool stores ("parts")
and back. Every part keeps the pool's leading dimensions `[blocks, block_size, kv_heads]`,
so writing a step's K/V is one `index_copy_` per part and reading a context is one
`index_select` per part followed by one decode of what was read — dequantize on read, no
Python loop over blocks.

    fp32, fp16, bf16   one part: the values in that dtype
    fp8_e4m3           one part: float8 e4m3 values, clamped to ±448 (the format's range);
                       offered where the installed torch converts to it on the device
    q8_0               codes int8 [..., d] + scales fp16 [..., d/32]: 34 bytes per 32 values
    q4_0               codes uint8 [..., d/2] (two 4-bit codes a byte) + scales fp16
                       [..., d/32]: 18 bytes per 32 values

The quantized formats are GGML's: per group of 32 values, q8_0 stores `d = max|x| / 127`
and `q = round(x / d)` (round half away from zero); q4_0 takes the value `m` of largest
magnitude, `d = m / -8` and `q = min(15, trunc(x / d + 8.5))`, value = `(q − 8) · d`, and
byte `j` of a group holds codes `j` (low nibble) and `j + 16` (high nibble). Arithmetic is
float32 like ggml's reference, so `to_gguf_blocks` of what `encode` produced is the same
bytes `gguf.quants.quantize` writes (tested bit for bit).
"""

from __future__ import annotations

import functools

import torch

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.formats import KV_FORMATS, KVFormat

GROUP = 32
FP8_MAX = 448.0
FLOAT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@functools.cache
def fp8_supported(device: torch.device) -> bool:
    """Whether this torch can store and read float8 e4m3 on `device` (tried once)."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return False
    try:
        x = torch.tensor([1.5, -2.0], device=device).to(dtype)
        return bool(torch.equal(x.float().cpu(), torch.tensor([1.5, -2.0])))
    except (RuntimeError, TypeError):
        return False


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (ggml rounds q8_0 codes this way; torch.round rounds half to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


class KVCodec:
    """One storage format's encode/decode."""

    def __init__(self, fmt: KVFormat):
        self.format = fmt
        self.name = fmt.name

    def part_shapes(self, head_dim: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Trailing shape and dtype of each stored part for rows of `head_dim` values."""
        if self.name in FLOAT_DTYPES:
            return [((head_dim,), FLOAT_DTYPES[self.name])]
        if self.name == "fp8_e4m3":
            return [((head_dim,), torch.float8_e4m3fn)]
        groups = head_dim // GROUP
        if self.name == "q8_0":
            return [((head_dim,), torch.int8), ((groups,), torch.float16)]
        return [((head_dim // 2,), torch.uint8), ((groups,), torch.float16)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Rows `[..., d]` (any float dtype) as this format's parts."""
        if self.name in FLOAT_DTYPES:
            return [x.to(FLOAT_DTYPES[self.name])]
        if self.name == "fp8_e4m3":
            return [x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)]
        g = x.float().reshape(*x.shape[:-1], -1, GROUP)
        if self.name == "q8_0":
            d = g.abs().amax(-1, keepdim=True) / 127
            inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
            q = _round_half_away(g * inv).to(torch.int8)
            return [q.reshape(x.shape), d.squeeze(-1).to(torch.float16)]
        # q4_0: the signed value of largest magnitude sets the scale.
        m = g.gather(-1, g.abs().argmax(-1, keepdim=True))
        d = m / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = torch.trunc(g * inv + 8.5).clamp(0, 15).to(torch.uint8)
        packed = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)
        return [packed.reshape(*x.shape[:-1], -1), d.squeeze(-1).to(torch.float16)]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Stored parts back to float rows `[..., d]` in `dtype`."""
        if len(parts) == 1:
            return parts[0].to(dtype)
        codes, scales = parts
        if self.name == "q8_0":
            g = codes.reshape(*codes.shape[:-1], -1, GROUP).to(dtype)
        else:
            b = codes.reshape(*codes.shape[:-1], -1, GROUP // 2)
            g = torch.cat((b & 0x0F, b >> 4), dim=-1).to(dtype) - 8
        out = g * scales.to(dtype).unsqueeze(-1)
        return out.reshape(*codes.shape[:-1], -1)

    def to_gguf_blocks(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Quantized parts of rows `[..., d]` as GGUF's block bytes `[..., d/32, 34 or 18]`
        (fp16 scale first, then the codes) — the layout llama.cpp reads from a file."""
        codes, scales = parts
        scale_bytes = scales.contiguous().view(torch.uint8).reshape(*scales.shape, 2)
        per = GROUP if self.name == "q8_0" else GROUP // 2
        code_bytes = codes.contiguous().view(torch.uint8).reshape(*scales.shape, per)
        return torch.cat((scale_bytes, code_bytes), dim=-1)


def get_codec(name: str, head_dim: int, device: torch.device) -> KVCodec:
    """The codec for a format name, or a ConfigError naming what is allowed here."""
    allowed = kv_formats_for(head_dim, device)
    if name not in allowed:
        why = ""
        if name in KV_FORMATS and name.startswith("q"):
            why = f" (head dim {head_dim} is not a multiple of {GROUP})"
        elif name == "fp8_e4m3":
            why = f" (this torch cannot store float8 e4m3 on {device.type})"
        raise ConfigError(f"kv_format {name!r} is not available here{why}; the torch executor "
                          f"stores KV as {', '.join(allowed)}.")
    return KVCodec(KV_FORMATS[name])


def kv_formats_for(head_dim: int, device: torch.device) -> list[str]:
    """The formats a pool for this head dimension can use on `device`."""
    names = list(FLOAT_DTYPES)
    if fp8_supported(device):
        names.append("fp8_e4m3")
    if head_dim % GROUP == 0:
        names += ["q8_0", "q4_0"]
    return names
