"""Gemma 3 (text): five sliding-window layers then one global, local RoPE base 10,000 and the
GGUF's base on global layers, QK-norm, RMSNorm before and after attention and FFN, GeGLU
(tanh GELU), embeddings scaled by sqrt(hidden), output head tied to the embeddings. llama.cpp
folds Gemma's `1 + w` RMSNorm weight into the stored tensor, so norms use `w` as stored. The
sliding-window pattern is derived in `info.py` (the GGUF stores only the window)."""

from kvdeck.runtime.models.arch import ArchSpec

GEMMA3 = ArchSpec(
    name="gemma3", rope_style="neox", qk_norm=True, post_norms=True,
    activation="gelu_tanh", embed_scale=True, local_rope_base=10_000.0,
)
