"""Dequantizing GGUF tensors into torch tensors of the compute dtype.

`gguf.quants.dequantize` handles every GGML type in numpy; Q8_0, F16, BF16 and F32 — the
bulk of small models, Gemma 3's 168M-element embedding table among them — take threaded
torch paths here instead (the generic Q8_0 path runs at ~23 M elements/s on a 2-core
machine, this one at ~200). Shapes come back in torch order (rows, columns): GGUF lists the
fastest dimension first.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from runtime.models.gguf import GGUFFile, TensorInfo

Q = GGMLQuantizationType


def _view(raw: np.ndarray) -> torch.Tensor:
    """A torch view of memory-mapped bytes. The map is read-only; every path below copies
    before writing, so torch's warning about non-writable arrays does not apply."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


def dequantize(g: GGUFFile, info: TensorInfo) -> torch.Tensor:
    """One tensor as a float32 torch tensor in torch shape order."""
    raw = g.tensor_bytes(info.name)
    shape = tuple(reversed(info.shape))
    qtype = Q(info.type_id)
    if qtype == Q.F32:
        flat = _view(raw).view(torch.float32).clone()
    elif qtype == Q.F16:
        flat = _view(raw).view(torch.float16).float()
    elif qtype == Q.BF16:
        flat = _view(raw).view(torch.bfloat16).float()
    elif qtype == Q.Q8_0:
        blocks = _view(raw.reshape(-1, 34))
        scales = blocks[:, :2].contiguous().view(torch.float16).float()
        flat = blocks[:, 2:].view(torch.int8).float() * scales
    else:
        rows = info.num_elements // info.shape[0]
        flat = torch.from_numpy(quants.dequantize(raw.reshape(rows, -1), qtype))
    return flat.reshape(shape)


def load_tensors(g: GGUFFile, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to `dtype` on `device`."""
    return {name: dequantize(g, info).to(device=device, dtype=dtype).contiguous()
            for name, info in g.tensors.items()}
