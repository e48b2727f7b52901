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
    from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def chat_model_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, an instruct GGUF with a chat template (the `chat-model`
    extra, which make test installs)."""
    from kvdeck.runtime.errors import ModelNotFoundError
    from kvdeck.runtime.models.registry import resolve_model

    try:
        return resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as e:  # a bare install without the extra
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    """(target, draft): Qwen2.5-Coder-1.5B-Instruct and 0.5B, one tokenizer (the
    `draft-models` extra, which make test installs)."""
    from kvdeck.runtime.errors import ModelNotFoundError
    from kvdeck.runtime.models.registry import resolve_model

    try:
        return resolve_model("qwen2.5-coder-1.5b"), resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as e:  # a bare install without the extra
        pytest.skip(str(e))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a CUDA device: skipped, with that reason, where torch sees
    none (one rule here rather than a skip condition beside every such test)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return  # torch is not imported for a run that has no such test
    import torch

    if not torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


# -- the suite's own memory ------------------------------------------------------------------
# The machine has 24 GiB, and models that fixtures or the allocator keep add up. After each
# test the process's resident memory is sampled; the run ends with the peak (the kernel's
# high-water mark, which catches peaks inside a test too), the tests after which the most
# was held and those that grew it most.

_samples: list[tuple[int, int, str]] = []
"""(RSS before the test's set-up, RSS after its teardown, node id)."""
_before: dict[str, tuple[int, int]] = {}
"""Per running test: (RSS, the high-water mark) before its set-up."""
_peak_during = ("", 0)
"""The test during which the high-water mark last rose (its own peak is the run's), and
the mark before it."""


def _high_water() -> int:
    """The process's peak resident memory so far, in bytes (ru_maxrss is in KiB on Linux,
    bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _release_freed_memory() -> None:
    """Collect cycles and hand freed heap pages back to the kernel (glibc keeps them in its
    per-thread arenas otherwise: model loads fill several at once, from torch's threads)."""
    import ctypes
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _before[item.nodeid] = (_rss(), _high_water())


RELEASE_AFTER_GROWTH = 256 << 20
"""A test that grew the process by more than this is followed by a collection: a model
inside a cycle (an app, an engine and its callbacks) otherwise waits for the collector's
next generation-2 pass, and the next test loads its own on top."""


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    before, mark = _before.pop(item.nodeid, (0, 0))
    if (nextitem is None or nextitem.module is not item.module
            or _rss() - before > RELEASE_AFTER_GROWTH):
        _release_freed_memory()  # after a module's fixtures were torn down, or a big test
    _samples.append((before, _rss(), item.nodeid))
    global _peak_during
    if _high_water() > mark:
        _peak_during = (item.nodeid, mark)


def pytest_terminal_summary(terminalreporter) -> None:
    peak = _high_water()
    write = terminalreporter.write_line
    write(f"pytest peak RSS {peak / 2**30:.2f} GiB (this process; the budget is 8 GiB)")
    if _peak_during[0]:
        write(f"  reached during {_peak_during[0]} (from {_peak_during[1] / 2**30:.2f} GiB)")
    for _, after, nodeid in sorted(_samples, key=lambda s: -s[1])[:3]:
        write(f"  {after / 2**30:.2f} GiB held after {nodeid}")
    for before, after, nodeid in sorted(_samples, key=lambda s: s[0] - s[1])[:3]:
        if after > before:
            write(f"  +{(after - before) / 2**30:.2f} GiB over {nodeid}")
