import os
from pathlib import Path

import pytest

from runtime.errors import ModelNotFoundError
from runtime.models import registry
from runtime.models.registry import CHUNKED_MODELS, list_models, resolve_model


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
