import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.formats import (
    KV_FORMATS,
    blocks_for_tokens,
    get_kv_format,
    kv_bytes_per_token,
)


@pytest.mark.parametrize(
    "fmt, expected",
    [
        ("fp32", 2 * 18 * 1 * 256 * 4),
        ("fp16", 18_432),  # 2 × 18 × 1 × 256 × 2, Gemma 3 270M
        ("bf16", 18_432),
        ("q8_0", 2 * 18 * 1 * (256 // 32) * 34),
        ("q4_0", 2 * 18 * 1 * (256 // 32) * 18),
    ],
)
def test_gemma_kv_bytes_per_token(fmt: str, expected: int) -> None:
    assert kv_bytes_per_token(18, 1, 256, KV_FORMATS[fmt]) == expected


def test_qwen3_8b_reference_kv_bytes() -> None:
    # docs/architecture.md, reference profile: 36 layers, 8 KV heads, head dim 128, BF16
    # -> 147,456 B = 144 KiB per token.
    assert kv_bytes_per_token(36, 8, 128, KV_FORMATS["bf16"]) == 147_456 == 144 * 1024


def test_quantized_rows_round_up_to_whole_groups() -> None:
    # A 40-value row needs two 32-value groups in q8_0: 68 bytes, not 40 × 34/32.
    assert KV_FORMATS["q8_0"].row_bytes(40) == 68
    assert KV_FORMATS["q4_0"].row_bytes(32) == 18
    assert KV_FORMATS["q8_0"].bytes_per_value == pytest.approx(34 / 32)


def test_blocks_and_tail_waste() -> None:
    for length in range(1, 200):
        for p in (1, 4, 16, 64):
            n = blocks_for_tokens(length, p)
            assert n * p >= length and n * p - length <= p - 1


def test_unknown_format_names_allowed() -> None:
    allowed = r"Unknown KV format 'int3'.*fp32, fp16, bf16, fp8_e4m3, q8_0, q4_0"
    with pytest.raises(ConfigError, match=allowed):
        get_kv_format("int3")
