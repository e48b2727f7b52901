from pathlib import Path

import numpy as np
import pytest

from kvdeck.runtime.errors import ModelFileError
from kvdeck.runtime.models.gguf import read_gguf
from kvdeck.runtime.models.info import model_report, read_model_info


def test_tiny_llama_metadata(tiny_llama: Path) -> None:
    info = read_model_info(tiny_llama)
    assert info.architecture == "llama"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (2, 4, 2, 16)
    assert info.vocab_size == 96 and info.context_length == 256
    assert info.sliding_window is None and info.sliding_window_layers == ()
    # All tensors were written as F32: bytes = 4 × elements.
    (only,) = info.tensor_types
    assert only.type_name == "F32"
    g = read_gguf(tiny_llama)
    try:
        total = sum(t.num_elements for t in g.tensors.values())
        assert only.num_bytes == info.weight_bytes == 4 * total
        assert only.num_tensors == len(g.tensors) == 1 + 2 * 9 + 2
        assert g.expected_size <= g.file_size < g.expected_size + g.alignment
        # The reader's tensor view returns exactly the bytes the writer stored.
        emb = g.tensor_bytes("token_embd.weight").view(np.float32).reshape(96, 64)
        assert np.isfinite(emb).all() and emb.std() > 0
    finally:
        g.close()
    # D_w excludes the embedding table (only gathered from) when the head is untied:
    # per layer q 64×64, k 32×64, v 32×64, o 64×64, gate/up/down 3 × 128×64; plus output 96×64.
    per_layer = 4096 + 2048 + 2048 + 4096 + 3 * 8192
    assert info.matrix_weight_bytes == 4 * (2 * per_layer + 96 * 64)


def test_tiny_gemma3_sliding_pattern_and_tied_head(tiny_gemma3: Path) -> None:
    info = read_model_info(tiny_gemma3)
    assert info.sliding_window == 8
    # Layer i is global when (i + 1) % 6 == 0: with 7 layers only layer 5 is global.
    assert info.sliding_window_layers == (0, 1, 2, 3, 4, 6)
    r = model_report(info, block_size=16)
    assert r["kv_bytes_per_token"]["fp16"] == 2 * 7 * 1 * 16 * 2
    # Tied output head: the embedding table counts as a matrix read every step.
    assert info.matrix_weight_bytes > 96 * 64 * 4


def test_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello, this is not a model file at all")
    with pytest.raises(ModelFileError, match="is not a GGUF file: it does not start with 'GGUF'"):
        read_gguf(bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf")


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="is not a file"):
        read_gguf(tmp_path)


@pytest.mark.parametrize("keep_fraction", [0.001, 0.5, 0.999])
def test_truncated_file(tiny_llama: Path, tmp_path: Path, keep_fraction: float) -> None:
    data = tiny_llama.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(24, int(len(data) * keep_fraction))])
    with pytest.raises(ModelFileError, match="is truncated"):
        read_gguf(cut)


def test_unsupported_version(tiny_llama: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_llama.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    old = tmp_path / "v1.gguf"
    old.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="version 1; kvdeck reads versions 2 and 3"):
        read_gguf(old)


@pytest.mark.slow
def test_real_gemma3_270m(gemma_path: Path) -> None:
    info = read_model_info(gemma_path)
    assert info.architecture == "gemma3"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (18, 4, 1, 256)
    assert (info.hidden_size, info.ffn_size, info.vocab_size) == (640, 2048, 262_144)
    assert info.sliding_window == 512
    assert info.sliding_window_layers == tuple(i for i in range(18) if i not in (5, 11, 17))
    assert info.kv_bytes_per_token("fp16") == 18_432
    assert info.weight_bytes + 6_525_120 == info.file_size  # header + data = whole file
    types = {t.type_name for t in info.tensor_types}
    assert {"Q8_0", "F32"} <= types
