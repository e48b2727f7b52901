"""Llama: SwiGLU, RMSNorm, RoPE on interleaved pairs (llama.cpp's GGUF layout)."""

from kvdeck.runtime.models.arch import ArchSpec

LLAMA = ArchSpec(name="llama", rope_style="norm")
