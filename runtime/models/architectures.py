"""The architectures kvdeck runs, by the name a GGUF header gives, and the model config of a
parsed GGUF. Adding an architecture: a file beside `llama.py` defining its `ArchSpec`, and one
entry here."""

from __future__ import annotations

import math

from kvdeck.runtime.errors import ModelFileError
from kvdeck.runtime.models.arch import ArchSpec, ModelConfig
from kvdeck.runtime.models.gemma3 import GEMMA3
from kvdeck.runtime.models.gguf import GGUFFile
from kvdeck.runtime.models.info import model_info_from_gguf
from kvdeck.runtime.models.llama import LLAMA
from kvdeck.runtime.models.qwen2 import QWEN2
from kvdeck.runtime.models.qwen3 import QWEN3

ARCHITECTURES: dict[str, ArchSpec] = {s.name: s for s in (LLAMA, QWEN2, QWEN3, GEMMA3)}


def model_config(g: GGUFFile) -> ModelConfig:
    """Build the config of a parsed GGUF, refusing architectures kvdeck cannot run."""
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
