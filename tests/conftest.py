"""Shared fixtures: tiny GGUF models written per session, and the real embedded model."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest

from tests.factories import TinySpec, write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", TinySpec())


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinySpec(arch="gemma3", num_layers=7, num_kv_heads=1, sliding_window=8)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf", spec)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real Gemma 3 270M GGUF, assembled from the `models` extra (installed by make test)."""
    from runtime.models.registry import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def chat_model_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, an instruct GGUF with a chat template (the `chat-model`
    extra, which make test installs)."""
    from runtime.errors import ModelNotFoundError
    from runtime.models.registry import resolve_model

    try:
        return resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as e:  # a bare install without the extra
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    """(target, draft): Qwen2.5-Coder-1.5B-Instruct and 0.5B, one tokenizer (the
    `draft-models` extra, which make test installs)."""
    from runtime.errors import ModelNotFoundError
    from runtime.models.registry import resolve_model

    try:
        return resolve_model("qwen2.5-coder-1.5b"), resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as e:  # a bare install without the extra
        pytest.skip(str(e))


# -- the suite's own memory ------------------------------------------------------------------
# The machine has 24 GiB and CI runs beside nothing else; models kept alive by fixtures
# add up. After each test the process's resident memory is sampled; the run ends with the
# peak (the kernel's high-water mark, which catches peaks inside a test too) and the tests
# after which the most was held.

_held: list[tuple[int, str]] = []


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _held.append((_rss(), item.nodeid))


def pytest_terminal_summary(terminalreporter) -> None:
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024
    top = sorted(_held, reverse=True)[:3]
    terminalreporter.write_line(f"pytest peak RSS {peak / 2**30:.2f} GiB (this process; "
                                "the budget is 8 GiB)")
    for rss, nodeid in top:
        terminalreporter.write_line(f"  {rss / 2**30:.2f} GiB held after {nodeid}")
