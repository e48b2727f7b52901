"""KV storage formats: q8_0/q4_0 packing equals GGML's reference bit for bit (through the
`gguf` package's numpy implementation, which mirrors ggml-quants.c), sizes are exact, and
decoding is what the format promises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.kv_codecs import KVCodec, fp8_supported, get_codec, kv_formats_for
from kvdeck.runtime.executors.paged_kv import PagedKVCache
from kvdeck.runtime.kv.formats import KV_FORMATS, kv_bytes_per_token

CPU = torch.device("cpu")
GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def random_rows(seed: int, shape=(5, 3, 256)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand((*shape[:-1], 1), generator=g) * 8
    x[0, 0, :32] = 0.0                 # an all-zero group: scale 0, codes at the midpoint
    x[0, 1, 32:64] = 3.0               # a constant group
    x[1, 0, :32] = torch.linspace(-1, 1, 32) * 1e-6  # tiny values
    return x


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packing_equals_ggml_reference_bit_for_bit(name: str, seed: int) -> None:
    x = random_rows(seed)
    codec = KVCodec(KV_FORMATS[name])
    parts = codec.encode(x)
    ours = codec.to_gguf_blocks(parts).reshape(-1).numpy()
    reference = quants.quantize(x.numpy().reshape(-1, 256), GGML[name]).reshape(-1)
    assert ours.dtype == reference.dtype == np.uint8
    assert np.array_equal(ours, reference)
    # Sizes: 34 / 18 bytes per 32 values, in the pool's parts and in GGUF's layout.
    per_group = {"q8_0": 34, "q4_0": 18}[name]
    assert ours.size == x.numel() // 32 * per_group
    assert sum(p.numel() * p.element_size() for p in parts) == ours.size
    # Unpacking equals GGML's dequantization exactly.
    decoded = codec.decode(parts, torch.float32).reshape(-1, 256).numpy()
    ref_rows = quants.dequantize(reference.reshape(x.numel() // 256, -1), GGML[name])
    assert np.array_equal(decoded, ref_rows.reshape(-1, 256))


def test_error_bounds_per_format() -> None:
    x = random_rows(3)
    amax = x.reshape(*x.shape[:-1], -1, 32).abs().amax(-1, keepdim=True)
    # Half a step of rounding (a full step for q4_0's clipped +8), plus the fp16 scale's own
    # rounding (relative 2^-11, absolute 2^-24 where it is subnormal) times the largest code.
    for name, bound in (("q8_0", (0.5 + 127 / 2048) / 127), ("q4_0", (1 + 8 / 2048) / 8)):
        codec = KVCodec(KV_FORMATS[name])
        err = codec.decode(codec.encode(x), torch.float32) - x
        err = err.reshape(amax.shape[:-1] + (32,))
        assert (err.abs() <= amax * bound + 127 * 2.0 ** -24).all(), name
    for name in ("fp32", "fp16", "bf16"):
        codec = KVCodec(KV_FORMATS[name])
        y = codec.decode(codec.encode(x), torch.float32)
        assert torch.equal(y, x.to(codec.part_shapes(256)[0][1]).float())


@pytest.mark.skipif(not fp8_supported(CPU), reason="this torch has no float8 on the CPU")
def test_fp8_stores_one_byte_and_saturates() -> None:
    codec = KVCodec(KV_FORMATS["fp8_e4m3"])
    x = torch.tensor([[0.0, 1.0, -2.5, 1000.0, -1000.0, 0.3]])
    (part,) = codec.encode(x)
    assert part.element_size() == 1
    y = codec.decode([part], torch.float32)
    assert y[0, :3].tolist() == [0.0, 1.0, -2.5]
    assert y[0, 3].item() == 448.0 and y[0, 4].item() == -448.0   # clamped, not NaN
    assert abs(y[0, 5].item() - 0.3) < 0.3 / 8


def test_pool_bytes_are_exact_for_every_format() -> None:
    layers, blocks, block_size, kv_heads, head_dim = 3, 10, 4, 2, 64
    for name in kv_formats_for(head_dim, CPU):
        fmt = KV_FORMATS[name]
        pool = PagedKVCache(layers, blocks, block_size, kv_heads, head_dim,
                            get_codec(name, head_dim, CPU), CPU)
        per_token = kv_bytes_per_token(layers, kv_heads, head_dim, fmt)
        assert pool.num_bytes == blocks * block_size * per_token, name


def test_pool_writes_reads_and_converts_between_formats() -> None:
    head_dim = 64
    pool = PagedKVCache(2, 8, 4, 1, head_dim, get_codec("fp16", head_dim, CPU), CPU)
    k = torch.randn(6, 1, head_dim)
    v = torch.randn(6, 1, head_dim)
    slots = torch.tensor([0, 1, 2, 3, 28, 29])  # blocks 0 and 7
    pool.write(1, slots, k, v)
    got_k, got_v = pool.gather(1, torch.tensor([0, 7]), torch.float32)
    assert torch.equal(got_k[[0, 1, 2, 3, 4, 5]], k.half().float())
    # fp16 -> fp32 is exact; block 7 moves to block 1 of a smaller pool.
    wide = pool.convert(get_codec("fp32", head_dim, CPU), 4, [0, 7], [0, 1])
    k2, v2 = wide.gather(1, torch.tensor([0, 1]), torch.float32)
    assert torch.equal(k2[:6], k.half().float()) and torch.equal(v2[:6], v.half().float())
    # fp32 -> q8_0 re-encodes: equal to encoding the same values directly.
    q8 = get_codec("q8_0", head_dim, CPU)
    small = wide.convert(q8, 4, [0, 1], [2, 3])
    k3, _ = small.gather(1, torch.tensor([2, 3]), torch.float32)
    assert torch.equal(k3[:6], q8.decode(q8.encode(k.half().float()), torch.float32))


def test_unavailable_formats_are_one_sentence() -> None:
    with pytest.raises(ConfigError, match=r"kv_format 'q8_0' is not available here \(head "
                                          r"dim 80 is not a multiple of 32\); the torch "
                                          r"executor stores KV as fp32, fp16, bf16"):
        get_codec("q8_0", 80, CPU)
    with pytest.raises(ConfigError, match="not available here"):
        get_codec("int3", 64, CPU)
