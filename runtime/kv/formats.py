"""KV cache element formats and their storage cost.

Quantized formats store values in groups of 32 along the head dimension: `q8_0` keeps 32
int8 codes plus one fp16 scale (34 bytes per 32 values), `q4_0` 32 4-bit codes plus one
fp16 scale (18 bytes per 32 values). Float formats store each value on its own (fp8_e4m3 in
one byte).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvdeck.runtime.errors import ConfigError


@dataclass(frozen=True)
class KVFormat:
    """One way of storing K and V values."""

    name: str
    values_per_group: int
    """How many values share one stored group (1 for float formats, 32 for q8_0/q4_0)."""
    bytes_per_group: int
    """Bytes one group occupies, codes and scale together."""

    @property
    def bytes_per_value(self) -> float:
        """Average bytes per stored value (34/32 for q8_0)."""
        return self.bytes_per_group / self.values_per_group

    def row_bytes(self, num_values: int) -> int:
        """Bytes for one row of `num_values` (a head's K or V vector); groups never span rows."""
        return math.ceil(num_values / self.values_per_group) * self.bytes_per_group


KV_FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("fp32", 1, 4),
        KVFormat("fp16", 1, 2),
        KVFormat("bf16", 1, 2),
        KVFormat("fp8_e4m3", 1, 1),
        KVFormat("q8_0", 32, 34),
        KVFormat("q4_0", 32, 18),
    )
}


def get_kv_format(name: str) -> KVFormat:
    """Look a format up by name; an unknown name raises a ConfigError listing the allowed ones."""
    try:
        return KV_FORMATS[name]
    except KeyError:
        allowed = ", ".join(KV_FORMATS)
        raise ConfigError(f"Unknown KV format {name!r}; allowed formats are {allowed}.") from None


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, fmt: KVFormat) -> int:
    """K and V bytes one token occupies across every layer: `2 × layers × kv_heads × row`.

    For float formats the row is `head_dim × bytes_per_element` (docs/architecture.md, "KV
    bytes per token").
    """
    return 2 * num_layers * num_kv_heads * fmt.row_bytes(head_dim)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of `num_tokens` needs: `ceil(L / p)`."""
    return -(-num_tokens // block_size)
