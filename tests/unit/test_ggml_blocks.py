"""The torch block decoders (`runtime/models/ggml_blocks.py`) give `gguf.quants`' values
bit for bit, on random blocks and on the shipped model's own tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvdeck.runtime.models.ggml_blocks import DECODERS
from kvdeck.runtime.models.gguf import read_gguf
from kvdeck.runtime.models.weights import dequantize

Q = GGMLQuantizationType
F16_FIELDS = {Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}
"""Byte offsets of each type's float16 scales, set to finite values below."""


@pytest.mark.parametrize("blocks", [1, 2, 300])
@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda q: q.name)
def test_random_blocks_decode_as_gguf_quants_does(qtype, blocks: int) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:  # random bytes would make some scales inf or NaN
        raw[:, at:at + 2] = rng.uniform(-2, 2, size=(blocks, 1)).astype(np.float16).view(
            np.uint8)
    want = quants.dequantize(raw.reshape(-1), qtype).reshape(blocks, -1)
    got = DECODERS[qtype](torch.from_numpy(raw))
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want)


def test_the_shipped_models_tensors_load_as_gguf_quants_decodes_them(gemma_path) -> None:
    """One tensor of each decoded type in Gemma 3 270M, through the loader's own path."""
    g = read_gguf(gemma_path)
    firsts = {}
    for name, info in g.tensors.items():
        firsts.setdefault(Q(info.type_id), (name, info))
    assert set(DECODERS) & set(firsts) >= {Q.Q5_0, Q.Q4_K, Q.Q6_K}
    for qtype in set(DECODERS) & set(firsts):
        name, info = firsts[qtype]
        want = quants.dequantize(g.tensor_bytes(name), qtype)
        got = dequantize(g, info)
        assert np.array_equal(got.numpy().reshape(-1), want.reshape(-1)), name
