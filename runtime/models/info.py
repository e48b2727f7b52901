"""What a serving engineer needs to know about a model, derived from its GGUF header."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvdeck.runtime.errors import ModelFileError
from kvdeck.runtime.kv.formats import KV_FORMATS, blocks_for_tokens, kv_bytes_per_token
from kvdeck.runtime.models.gguf import GGUFFile, iter_tensor_types, read_gguf
from kvdeck.runtime.models.weight_formats import GROUPS


@dataclass(frozen=True)
class TensorTypeSummary:
    """Tensors of one GGML type: how many and how many bytes."""

    type_name: str
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True)
class ModelInfo:
    """Architecture facts and storage figures of one GGUF model."""

    path: Path
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int
    sliding_window: int | None
    """Window of the local (sliding-window) layers, in tokens; None when every layer is global."""
    sliding_window_layers: tuple[int, ...]
    rope_freq_base: float
    tensor_types: tuple[TensorTypeSummary, ...]
    weight_bytes: int
    matrix_weight_bytes: int
    """Bytes of matrix weights a decode step reads once (D_w): every 2-D tensor except the
    embedding table, which is only gathered from, unless the output head is tied to it."""
    file_size: int
    group_bytes: tuple[tuple[str, int], ...] = ()
    """Matrix bytes per weight group as the `weight_format` knob names them (`attn`: the
    attention projections, `ffn`: the feed-forward matrices, `head`: the output head), from
    the tensors' names (`weight_groups`)."""
    has_chat_template: bool = False
    """The file carries `tokenizer.chat_template`: an instruct (chat-tuned) model; without
    one, a base model that continues text rather than answering it."""

    @property
    def kind(self) -> str:
        return "instruct" if self.has_chat_template else "base"

    def kv_bytes_per_token(self, kv_format: str) -> int:
        """K and V bytes per token across all layers in the named KV format."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                  KV_FORMATS[kv_format])


def _sliding_layers(g: GGUFFile, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    window = g.get(f"{arch}.attention.sliding_window")
    if not window:
        return None, ()
    pattern = g.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == num_layers:
        return int(window), tuple(i for i, local in enumerate(pattern) if local)
    if arch == "gemma3":
        # The GGUF stores the window but not the pattern: five local layers, then one global.
        return int(window), tuple(i for i in range(num_layers) if (i + 1) % 6 != 0)
    if arch == "gemma2":
        return int(window), tuple(i for i in range(num_layers) if i % 2 == 0)
    # Other architectures that store a window apply it on every layer.
    return int(window), tuple(range(num_layers))


def _required(g: GGUFFile, key: str) -> int:
    value = g.get(key)
    if value is None:
        raise ModelFileError(f"{g.path} lacks the metadata key {key!r} that every model needs.")
    if isinstance(value, list):
        # Some files store per-layer head counts; kvdeck sizes KV by the largest.
        value = max(value)
    return int(value)


def weight_groups(g: GGUFFile, tied: bool) -> tuple[tuple[str, int], ...]:
    """(group, matrix bytes) for `attn`, `ffn` and `head`, by GGUF tensor name: a layer's
    `attn_*` and `ffn_*` matrices, and the output head (the embedding table when tied)."""
    out = dict.fromkeys(GROUPS, 0)
    for t in g.tensors.values():
        if len(t.shape) < 2:
            continue
        if t.name == "output.weight" or (tied and t.name == "token_embd.weight"):
            out["head"] += t.num_bytes
        elif t.name.startswith("blk.") and ".attn_" in t.name:
            out["attn"] += t.num_bytes
        elif t.name.startswith("blk.") and ".ffn_" in t.name:
            out["ffn"] += t.num_bytes
    return tuple(out.items())


def model_info_from_gguf(g: GGUFFile) -> ModelInfo:
    """Derive the model facts from a parsed GGUF header."""
    arch = g.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{g.path} has no general.architecture; it is not a model file.")
    num_layers = _required(g, f"{arch}.block_count")
    hidden = _required(g, f"{arch}.embedding_length")
    num_heads = _required(g, f"{arch}.attention.head_count")
    kv_heads = g.get(f"{arch}.attention.head_count_kv", num_heads)
    kv_heads = int(max(kv_heads) if isinstance(kv_heads, list) else kv_heads)
    head_dim = int(g.get(f"{arch}.attention.key_length", hidden // num_heads))
    ffn = g.get(f"{arch}.feed_forward_length", 0)
    ffn = int(max(ffn) if isinstance(ffn, list) else ffn)
    tokens = g.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = tokens.count if hasattr(tokens, "count") and not isinstance(tokens, list) \
            else len(tokens)
    else:
        emb = g.tensors.get("token_embd.weight")
        vocab = emb.shape[-1] if emb else 0
    window, local_layers = _sliding_layers(g, arch, num_layers)
    tied = "output.weight" not in g.tensors
    matrix_bytes = sum(
        t.num_bytes for t in g.tensors.values()
        if len(t.shape) >= 2 and (t.name != "token_embd.weight" or tied)
    )
    return ModelInfo(
        path=g.path,
        name=str(g.get("general.name", g.path.stem)),
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_size=ffn,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        context_length=int(g.get(f"{arch}.context_length", 0)),
        vocab_size=int(vocab),
        sliding_window=window,
        sliding_window_layers=local_layers,
        rope_freq_base=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        tensor_types=tuple(TensorTypeSummary(*t) for t in iter_tensor_types(g)),
        weight_bytes=sum(t.num_bytes for t in g.tensors.values()),
        matrix_weight_bytes=matrix_bytes,
        file_size=g.file_size,
        group_bytes=weight_groups(g, tied),
        has_chat_template=g.get("tokenizer.chat_template") is not None,
    )


def read_model_info(path: str | Path) -> ModelInfo:
    """Parse a GGUF file and return its model facts; the memory map is closed afterwards."""
    g = read_gguf(path)
    try:
        return model_info_from_gguf(g)
    finally:
        g.close()


def model_report(info: ModelInfo, block_size: int = 16) -> dict:
    """The facts `kvdeck models NAME` prints, as plain JSON-ready data."""
    kv = {name: info.kv_bytes_per_token(name) for name in KV_FORMATS}
    return {
        "name": info.name,
        "path": str(info.path),
        "architecture": info.architecture,
        "kind": info.kind,
        "chat_template": info.has_chat_template,
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "ffn_size": info.ffn_size,
        "num_heads": info.num_heads,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "sliding_window": info.sliding_window,
        "sliding_window_layers": list(info.sliding_window_layers),
        "rope_freq_base": info.rope_freq_base,
        "tensor_types": [
            {"type": t.type_name, "count": t.num_tensors, "bytes": t.num_bytes}
            for t in info.tensor_types
        ],
        "weight_bytes": info.weight_bytes,
        "matrix_weight_bytes": info.matrix_weight_bytes,
        "file_size": info.file_size,
        "kv_bytes_per_token": kv,
        "block_size": block_size,
        "blocks_per_1k_tokens": blocks_for_tokens(1024, block_size),
        "kv_bytes_per_block": {name: b * block_size for name, b in kv.items()},
        "kv_bytes_full_context": {name: b * info.context_length for name, b in kv.items()},
    }
