"""LoRA adapters on the `llama_cpp` executor, through llama.cpp's adapter API.

llama.cpp applies adapters to a whole context (`llama_set_adapters_lora`), not to a row, so
the executor groups a step's rows by adapter and decodes each group in a `llama_decode` of
its own with its adapter set; the base model's rows go in a group with none. A step mixing
`k` adapters and the base model therefore makes up to `k + 1` passes over the weights,
where the torch executor makes one (its batched low-rank update, `runtime/models/lora.py`):
mixed batches cost more here. `--max-loras N` bounds the adapters in one batch, and so the
passes a step makes; every adapter stays loaded (llama.cpp keeps them with the model).

Files: a llama.cpp adapter GGUF is handed to llama.cpp as it is; a PEFT folder is read by
kvdeck's own reader and written as one (`lora.write_gguf`, cached per file's bytes). Either
is first read by kvdeck, so a malformed file gets the same sentence as on torch; llama.cpp
then checks every matrix against the model and refuses an adapter made for another.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.llama_cpp_context import LlamaModel, Row, lib, one_batch
from kvdeck.runtime.models.architectures import ARCHITECTURES
from kvdeck.runtime.models.lora import load_adapter, write_gguf
from kvdeck.runtime.resources import cache_dir
from kvdeck.runtime.text.tokenizer import quiet_stderr


class LlamaAdapters:
    """The adapters loaded into one llama.cpp model, by name."""

    def __init__(self, model: LlamaModel, arch: str):
        self.model, self.arch = model, arch
        self.pointers: dict[str, object] = {}
        self.num_bytes: dict[str, int] = {}

    def load(self, name: str, path: str | Path) -> int:
        """Load the adapter at `path` as `name`; its bytes. ConfigError with one sentence
        when it cannot be served on this model."""
        adapter = load_adapter(name, path)
        spec = ARCHITECTURES.get(self.arch)
        if (spec is None or spec.rope_style != "neox") and \
                any(m in ("wq", "wk") for _, m in adapter.updates):
            raise ConfigError(f"The LoRA adapter {name!r} updates Q or K, whose rows a "
                              f"{self.arch} GGUF stores permuted from the Hugging Face order "
                              "adapters are trained in; kvdeck applies such adapters to "
                              "Gemma and Qwen models only.")
        gguf_path = Path(path)
        if gguf_path.suffix != ".gguf":  # PEFT: written once as llama.cpp reads adapters
            key = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(
                (gguf_path if gguf_path.is_dir() else gguf_path.parent).glob("adapter_*"))))
            gguf_path = write_gguf(adapter, cache_dir() / "lora" /
                                   f"{self.arch}-{key.hexdigest()[:16]}.gguf", self.arch)
        with quiet_stderr():
            ptr = lib().llama_adapter_lora_init(self.model.ptr, str(gguf_path).encode())
        if not ptr:
            raise ConfigError(f"The LoRA adapter {name!r} was made for another base model: "
                              f"llama.cpp could not apply {path} to this {self.arch} model.")
        self.pointers[name] = ptr
        self.num_bytes[name] = adapter.num_bytes
        return adapter.num_bytes

    def describe(self) -> str:
        n = len(self.pointers)
        if not n:
            return ""
        return (f"LoRA {n}/{n} resident · {sum(self.num_bytes.values()) / 2**20:.1f} MiB "
                "(llama.cpp: one pass per adapter in a step)")

    def group(self, groups: list[list[Row]], names: list[str | None], one: bool
              ) -> tuple[list[list[Row]], list[object] | None]:
        """The step's row groups (one per chunk, `names` their adapters) regrouped for
        decoding, and the adapter of each (None throughout when no row uses one): per
        adapter, in order of first use, its rows in one batch (`one`) or a group per chunk
        as they came."""
        if not any(names):
            return (one_batch(groups) if one else groups), None
        out: list[list[Row]] = []
        adapters: list[object] = []
        for name in dict.fromkeys(names):
            mine = [g for g, n in zip(groups, names, strict=True) if n == name]
            mine = one_batch(mine) if one else mine
            out.extend(mine)
            adapters.extend([self.pointers[name] if name else None] * len(mine))
        return out, adapters

