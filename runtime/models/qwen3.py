"""Qwen3: like Qwen2 without Q/K/V biases, with RMSNorm on every query and key head."""

from kvdeck.runtime.models.arch import ArchSpec

QWEN3 = ArchSpec(name="qwen3", rope_style="neox", qk_norm=True)
