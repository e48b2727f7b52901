"""Dequantizing GGUF tensors into torch tensors of the compute dtype.

`gguf.quants.dequantize` handles every GGML type in numpy; Q8_0, F16, BF16 and F32 — the
bulk of small models, Gemma 3's 168M-element embedding table among them — take threaded
torch paths here instead (the generic Q8_0 path runs at ~23 M elements/s on a 2-core
machine, this one at ~200), and so do the block types of `ggml_blocks`. Shapes come back
in torch order (rows, columns): GGUF lists the fastest dimension first.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvdeck.runtime.models.ggml_blocks import DECODERS
from kvdeck.runtime.models.gguf import GGUFFile, TensorInfo

Q = GGMLQuantizationType


def _view(raw: np.ndarray) -> torch.Tensor:
    """A torch view of memory-mapped bytes. The map is read-only; every path below copies
    before writing, so torch's warning about non-writable arrays does not apply."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


CHUNK_ELEMENTS = 1 << 24
"""Elements dequantized at a time: a large tensor's float32 working copy (Qwen2.5's
151,936 × 1,536 embedding is 0.9 GB in float32) stays at 64 MB instead of its whole size,
so loading in bf16 never holds a float32 copy of the model's biggest tensor."""


def _rows_f32(rows: np.ndarray, qtype: Q) -> torch.Tensor:
    """Raw bytes of whole rows, [r, row bytes], as float32 [r, columns]."""
    r = rows.shape[0]
    if qtype == Q.F32:
        flat = _view(rows).view(torch.float32)
    elif qtype == Q.F16:
        flat = _view(rows).view(torch.float16).float()
    elif qtype == Q.BF16:
        flat = _view(rows).view(torch.bfloat16).float()
    elif qtype == Q.Q8_0:
        blocks = _view(rows.reshape(-1, 34))
        scales = blocks[:, :2].contiguous().view(torch.float16).float()
        flat = blocks[:, 2:].view(torch.int8).float() * scales
    elif qtype in DECODERS:
        flat = DECODERS[qtype](_view(rows.reshape(-1, GGML_QUANT_SIZES[qtype][1])))
    else:
        flat = torch.from_numpy(quants.dequantize(rows, qtype))
    return flat.reshape(r, -1)


def dequantize(g: GGUFFile, info: TensorInfo, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """One tensor in torch shape order, as `dtype` on `device`, dequantized a chunk of
    rows at a time into its final buffer."""
    raw = g.tensor_bytes(info.name)
    shape = tuple(reversed(info.shape))
    qtype = Q(info.type_id)
    columns = max(1, info.shape[0]) if info.shape else 1
    num_rows = info.num_elements // columns
    rows = raw.reshape(num_rows, -1)
    out = torch.empty((num_rows, columns), dtype=dtype, device=device)
    step = max(1, CHUNK_ELEMENTS // columns)
    for first in range(0, num_rows, step):
        out[first:first + step] = _rows_f32(rows[first:first + step], qtype)
    return out.reshape(shape)


def load_tensors(g: GGUFFile, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to `dtype` on `device`; each tensor's file
    pages are dropped once it is read."""
    out = {}
    for name, info in g.tensors.items():
        out[name] = dequantize(g, info, dtype, device)
        g.drop_pages(name)
    return out
