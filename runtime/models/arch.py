"""Architecture descriptions: what differs between the decoder families kvdeck runs.

One `ArchSpec` per architecture (`llama.py`, `qwen2.py`, `qwen3.py`, `gemma3.py` register
theirs); `ModelConfig` combines a spec with the numbers in a GGUF header.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvdeck.runtime.errors import ModelFileError
from kvdeck.runtime.models.gguf import GGUFFile
from kvdeck.runtime.models.info import ModelInfo, model_info_from_gguf


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


ARCHITECTURES: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    ARCHITECTURES[spec.name] = spec
    return spec


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


def model_config(g: GGUFFile) -> ModelConfig:
    """Build the config of a parsed GGUF, refusing architectures kvdeck cannot run."""
    # Import for registration side effects: each file registers its ArchSpec.
    from kvdeck.runtime.models import gemma3, llama, qwen2, qwen3  # noqa: F401

    info = model_info_from_gguf(g)
    spec = ARCHITECTURES.get(info.architecture)
    if spec is None:
        raise ModelFileError(
            f"{g.path} is a {info.architecture!r} model; the torch executor runs "
            f"{', '.join(sorted(ARCHITECTURES))}."
        )
    a = info.architecture
    eos = g.get("tokenizer.ggml.eos_token_id")
    eot = g.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    bos = g.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=spec,
        info=info,
        rms_eps=float(g.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        attn_scale=1.0 / math.sqrt(info.head_dim),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        add_bos=bool(g.get("tokenizer.ggml.add_bos_token", spec.name in ("llama", "gemma3"))),
    )
