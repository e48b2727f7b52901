import os
from pathlib import Path

import pytest

from kvdeck.runtime.errors import ModelNotFoundError
from kvdeck.runtime.models import registry
from kvdeck.runtime.models.registry import CHUNKED_MODELS, list_models, resolve_model


@pytest.fixture()
def isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVDECK_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_user_directory_models_are_listed_and_resolved(isolated_dirs: Path, tiny_llama: Path):
    models = isolated_dirs / "models"
    models.mkdir()
    (models / "mine.gguf").write_bytes(tiny_llama.read_bytes())
    names = {e.name: e for e in list_models()}
    assert names["mine"].source == "user directory" and names["mine"].available
    assert resolve_model("mine") == models / "mine.gguf"


def test_unknown_name_lists_known_models(isolated_dirs: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"Unknown model 'llama-9000'; known models are "
                                                 r"gemma3-270m.*or give a path to a \.gguf file"):
        resolve_model("llama-9000")


def test_uninstalled_chunked_model_names_the_extra(monkeypatch, isolated_dirs: Path) -> None:
    fake = registry.ChunkedModel("ghost", "not installed", ("kvdeck_no_such_part1",),
                                 registry._numbered_part, "draft-models")
    monkeypatch.setitem(CHUNKED_MODELS, "ghost", fake)
    with pytest.raises(ModelNotFoundError,
                       match=r"'ghost' is not installed .*pip install 'kvdeck\[draft-models\]'"):
        resolve_model("ghost")
    assert {e.name: e.available for e in list_models()}["ghost"] is False


@pytest.mark.slow
def test_embedded_model_assembles_once_and_is_reused(isolated_dirs: Path) -> None:
    model = CHUNKED_MODELS["gemma3-270m"]
    assert model.is_installed(), "make test installs the 'models' extra"
    entry = {e.name: e for e in list_models()}["gemma3-270m"]
    assert entry.note == "assembled on first use"
    path = resolve_model("gemma3-270m")
    assert path.is_file() and path.read_bytes()[:4] == b"GGUF"
    stamp = path.stat().st_mtime_ns
    assert resolve_model("gemma3-270m") == path and path.stat().st_mtime_ns == stamp
    # A damaged file (wrong size) is noticed and rebuilt.
    with path.open("r+b") as f:
        f.truncate(1000)
    rebuilt = resolve_model("gemma3-270m")
    assert rebuilt.stat().st_size == sum(p.stat().st_size for p in model.chunk_paths())
    assert not [p for p in os.listdir(path.parent) if p.endswith(".part")]


@pytest.mark.parametrize("pin", ["right", "wrong"])
def test_a_pinned_checksum_guards_packages_that_publish_none(
        monkeypatch, isolated_dirs: Path, tiny_llama: Path, pin: str) -> None:
    """The Qwen chunk packages ship no checksum; kvdeck pins the SHA-256 of the file it was
    tested with, and an assembly that does not match is refused, never cached."""
    import hashlib

    from kvdeck.runtime.errors import ModelFileError

    data = tiny_llama.read_bytes()
    chunks = [isolated_dirs / "part1.bin", isolated_dirs / "part2.bin"]
    chunks[0].write_bytes(data[:1000])
    chunks[1].write_bytes(data[1000:])
    sha = hashlib.sha256(data).hexdigest() if pin == "right" else "0" * 64
    fake = registry.ChunkedModel("pinned", "a chunked test model", ("json", "os"),
                                 lambda module, i: chunks[i], "draft-models", sha256=sha)
    monkeypatch.setitem(CHUNKED_MODELS, "pinned", fake)
    if pin == "right":
        path = resolve_model("pinned")
        assert path.read_bytes() == data
    else:
        with pytest.raises(ModelFileError, match=r"does not match its expected SHA-256 "
                                                 r"\(pinned by kvdeck\).*"
                                                 r"kvdeck\[draft-models\]"):
            resolve_model("pinned")
        assert not list((isolated_dirs / "cache").rglob("*.gguf"))
    assert CHUNKED_MODELS["qwen2.5-coder-0.5b"].expected_sha256() and \
        CHUNKED_MODELS["qwen2.5-coder-1.5b"].expected_sha256()
