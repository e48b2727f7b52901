"""LoRA adapters for tests, written in the two forms kvdeck reads: PEFT's folder and
llama.cpp's adapter GGUF. Their weights are seeded random numbers of a trained adapter's
scale (B small, A ~ 1/√inputs), enough to change a model's greedy answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PEFT_NAMES = {"wq": "self_attn.q_proj", "wv": "self_attn.v_proj", "w_up": "mlp.up_proj",
              "w_down": "mlp.down_proj"}
GGUF_NAMES = {"wq": "attn_q", "wv": "attn_v", "w_up": "ffn_up", "w_down": "ffn_down"}


def updates(shapes: list[dict[str, tuple[int, int]]], seed: int, rank: int
            ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, matrix) → (A [rank, inputs], B [outputs, rank]) for every layer's targets
    (`shapes`: per layer, each matrix's (outputs, inputs))."""
    rng = np.random.default_rng(seed)
    return {(i, m): ((rng.standard_normal((rank, cols)) / cols ** 0.5).astype(np.float32),
                     (rng.standard_normal((rows, rank)) * 0.02).astype(np.float32))
            for i, layer in enumerate(shapes) for m, (rows, cols) in layer.items()
            if m in PEFT_NAMES}


def write_peft(folder: Path, shapes: list[dict], seed: int, rank: int = 8,
               alpha: int = 16) -> Path:
    from safetensors.numpy import save_file

    tensors = {}
    for (i, m), (a, b) in updates(shapes, seed, rank).items():
        key = f"base_model.model.model.layers.{i}.{PEFT_NAMES[m]}"
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "r": rank, "lora_alpha": alpha, "peft_type": "LORA",
        "target_modules": sorted(n.split(".")[-1] for n in PEFT_NAMES.values())}))
    return folder


def write_gguf(path: Path, shapes: list[dict], seed: int, rank: int = 8,
               alpha: int = 16) -> Path:
    """As llama.cpp's `convert_lora_to_gguf.py` writes one: general.type adapter,
    adapter.type lora, adapter.lora.alpha, `blk.N.<tensor>.weight.lora_{a,b}`."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    for (i, m), (a, b) in updates(shapes, seed, rank).items():
        w.add_tensor(f"blk.{i}.{GGUF_NAMES[m]}.weight.lora_a", a)
        w.add_tensor(f"blk.{i}.{GGUF_NAMES[m]}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def shapes_of(model) -> list[dict[str, tuple[int, int]]]:
    """Per layer, each matrix's (outputs, inputs) of a loaded `Transformer`."""
    return [{m: tuple(w.shape) for m, (w, _) in layer.items()} for layer in model.masters]
