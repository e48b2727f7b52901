"""How llama.cpp's native objects are released (`llama_cpp_context.released`): once, by
their owner's `close()` or, where that never came, by the collector; and a context's model
is held until the context is freed, however the two are collected."""

from __future__ import annotations

import gc
import weakref

from kvdeck.runtime.executors.llama_cpp_context import released


class Owner:
    """Stands for a `LlamaModel` or `LlamaContext`: what the release is tied to."""


def test_close_then_collection_frees_once() -> None:
    freed: list[str] = []
    owner = Owner()
    free = released(owner, freed.append, "ctx")
    free()
    free()  # close() twice
    del owner
    gc.collect()
    assert freed == ["ctx"]


def test_an_owner_collected_in_a_cycle_without_close_is_freed() -> None:
    """As an executor is, with its engine and callbacks pointing back at it."""
    freed: list[str] = []
    owner = Owner()
    owner.free = released(owner, freed.append, "model")
    owner.itself = owner
    del owner
    gc.collect()
    assert freed == ["model"]


def test_an_argument_of_the_release_outlives_its_owner() -> None:
    """The context's release holds its model: the model cannot be freed first."""
    context, model = Owner(), Owner()
    gone = weakref.ref(model)
    released(context, lambda keep: None, model)
    del model
    gc.collect()
    assert gone() is not None
    del context
    gc.collect()
    assert gone() is None
