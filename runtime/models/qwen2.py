"""Qwen2 / Qwen2.5: GQA with biases on Q, K and V; SwiGLU; RMSNorm; NeoX-style RoPE."""

from kvdeck.runtime.models.arch import ArchSpec

QWEN2 = ArchSpec(name="qwen2", rope_style="neox", qkv_bias=True)
