"""Architecture descriptions: what differs between the decoder families kvdeck runs.

One `ArchSpec` per architecture (`llama.py`, `qwen2.py`, `qwen3.py`, `gemma3.py` each
define theirs; `architectures.py` lists them); `ModelConfig` combines a spec with the numbers
in a GGUF header.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdeck.runtime.models.info import ModelInfo


@dataclass(frozen=True)
class ArchSpec:
    """The structural choices of a decoder-only transformer family."""

    name: str
    rope_style: str
    """'norm': rotate interleaved pairs (llama.cpp permutes llama's Q/K into this layout);
    'neox': rotate the two halves of each head."""
    qkv_bias: bool = False
    qk_norm: bool = False
    """RMSNorm on each query and key head (Qwen3, Gemma 3)."""
    post_norms: bool = False
    """RMSNorm after attention and after the FFN, before the residual add (Gemma)."""
    activation: str = "silu"
    """Gate activation of the gated FFN: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU)."""
    embed_scale: bool = False
    """Multiply token embeddings by sqrt(hidden) (Gemma)."""
    local_rope_base: float | None = None
    """RoPE base of sliding-window layers when it differs from the global one (Gemma 3)."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about one model file."""

    arch: ArchSpec
    info: ModelInfo
    rms_eps: float
    attn_scale: float
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool

    @property
    def num_layers(self) -> int:
        return self.info.num_layers

    def is_local(self, layer: int) -> bool:
        return layer in self.info.sliding_window_layers

    def rope_base(self, layer: int) -> float:
        if self.is_local(layer) and self.arch.local_rope_base is not None:
            return self.arch.local_rope_base
        return self.info.rope_freq_base

    def window(self, layer: int) -> int | None:
        """Keys a query of this layer may see (including itself), or None for all."""
        return self.info.sliding_window if self.is_local(layer) else None
