"""Tiny GGUF models written at test time with the `gguf` writer.

Shapes follow llama.cpp's tensor naming for each architecture, with random weights, so the
metadata reader and (later) the executors can be tested without any download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    vocab: int = 96
    context: int = 256
    sliding_window: int | None = None
    seed: int = 0


def write_tiny_gguf(path: Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a small random model of `spec.arch` shape to `path` and return the path."""
    rng = np.random.default_rng(spec.seed)
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(f"tiny-{spec.arch}")
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
    tokens = [f"<t{i}>" for i in range(spec.vocab)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * spec.vocab)
    w.add_token_types([1] * spec.vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def vec(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    q_dim = spec.num_heads * spec.head_dim
    kv_dim = spec.num_kv_heads * spec.head_dim
    w.add_tensor("token_embd.weight", mat(spec.vocab, spec.hidden))
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", vec(spec.hidden))
        w.add_tensor(p + "attn_q.weight", mat(q_dim, spec.hidden))
        w.add_tensor(p + "attn_k.weight", mat(kv_dim, spec.hidden))
        w.add_tensor(p + "attn_v.weight", mat(kv_dim, spec.hidden))
        w.add_tensor(p + "attn_output.weight", mat(spec.hidden, q_dim))
        if spec.arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", vec(q_dim) - 1.0)
            w.add_tensor(p + "attn_k.bias", vec(kv_dim) - 1.0)
            w.add_tensor(p + "attn_v.bias", vec(kv_dim) - 1.0)
        if spec.arch in ("gemma3", "qwen3"):
            w.add_tensor(p + "attn_q_norm.weight", vec(spec.head_dim))
            w.add_tensor(p + "attn_k_norm.weight", vec(spec.head_dim))
        if spec.arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", vec(spec.hidden))
            w.add_tensor(p + "post_ffw_norm.weight", vec(spec.hidden))
        w.add_tensor(p + "ffn_norm.weight", vec(spec.hidden))
        w.add_tensor(p + "ffn_gate.weight", mat(spec.ffn, spec.hidden))
        w.add_tensor(p + "ffn_up.weight", mat(spec.ffn, spec.hidden))
        w.add_tensor(p + "ffn_down.weight", mat(spec.hidden, spec.ffn))
    w.add_tensor("output_norm.weight", vec(spec.hidden))
    if spec.arch != "gemma3":  # Gemma ties the output head to the embedding table
        w.add_tensor("output.weight", mat(spec.vocab, spec.hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
