"""llama-server's host prompt cache in the sim (`executors/server_prompt_cache.py`): which
states it holds, and which it drops past `--cache-ram` and the server's context."""

from __future__ import annotations

import pytest

from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.executors.server_prompt_cache import PromptCache
from kvdeck.runtime.executors.server_slots import ServerSlots

MIB = 1 << 20


def tokens(first: int, n: int) -> tuple[int, ...]:
    return tuple(range(first, first + n))


def test_a_state_within_one_held_is_not_saved_and_one_within_the_new_goes() -> None:
    cache = PromptCache()
    assert cache.save(tokens(0, 10))
    assert cache.holds(tokens(0, 6)) and not cache.save(tokens(0, 6))  # "already in"
    assert not cache.holds(tokens(1, 6))
    assert cache.save(tokens(0, 14))  # begins with the first: "obsolete", removed
    assert [len(t) for t, _ in cache.states] == [14]
    assert cache.save(tokens(50, 3))
    assert [t[0] for t, _ in cache.states] == [0, 50]  # oldest first
    assert not cache.save(())


def test_a_save_makes_room_under_cache_ram_and_a_state_larger_than_it_is_not_saved() -> None:
    """0.1 MiB a token, --cache-ram 2: a third state of 8 tokens needs 0.8 MiB where two
    hold 1.6, so the oldest goes first; a state of 30 tokens (3 MiB) is not saved at all."""
    cache = PromptCache(lambda n: n * MIB / 10, cache_ram_mib=2)
    for first in (0, 100, 200):
        assert cache.save(tokens(first, 8))
    assert [t[0] for t, _ in cache.states] == [100, 200]
    assert not cache.save(tokens(300, 30))
    assert [t[0] for t, _ in cache.states] == [100, 200]


def test_the_context_bounds_its_tokens_unless_cache_ram_holds_more() -> None:
    """Context of 20 tokens. With no byte limit (-1), three states of 8 tokens (24) drop
    the oldest, and a state longer than the context is saved, then dropped with the rest.
    With 1 MiB at 1 KiB a token, the limit is the 1,024 tokens that fit."""
    unbounded = PromptCache(lambda n: n * 1024, cache_ram_mib=-1, context_tokens=20)
    bounded = PromptCache(lambda n: n * 1024, cache_ram_mib=1, context_tokens=20)
    for first in (0, 100, 200):
        unbounded.save(tokens(first, 8))
        bounded.save(tokens(first, 8))
    assert [t[0] for t, _ in unbounded.states] == [100, 200]
    assert [t[0] for t, _ in bounded.states] == [0, 100, 200]
    assert unbounded.save(tokens(300, 21)) and unbounded.states == []


def ended(slots: ServerSlots, rid: str, prompt: list[int]) -> None:
    """A request of three outputs, run in its slot to its end."""
    r = Request(rid, prompt, SamplingParams(max_tokens=3))
    slots.slot(r)
    r.output_token_ids.extend([7, 8, 9])
    slots.release(rid)


@pytest.mark.parametrize(("context", "hold"), [(0, 0.0), (60, 0.042)])
def test_a_state_dropped_past_the_limit_is_saved_again(context: int, hold: float) -> None:
    """A's 42-token state is saved at B's launch, B's at C's. In a cache of 60 tokens B's
    state drops A's, so A2 (A's prompt again, the same outputs) leaves a state D's launch
    saves again (42 ms at 1 ms a token); a cache without limits still holds it."""
    slots = ServerSlots(4, save_seconds=lambda n: n * 1e-3,
                        cache=PromptCache(cache_ram_mib=-1, context_tokens=context))
    ended(slots, "A", list(range(40)))
    b = Request("B", [5] * 40, SamplingParams(max_tokens=3))
    assert slots.launch_hold([b]) == pytest.approx(0.042)
    ended(slots, "B", [5] * 40)
    assert slots.launch_hold([Request("C", [6] * 40, SamplingParams(max_tokens=3))]) == \
        pytest.approx(0.042)
    ended(slots, "A2", list(range(40)))
    assert slots.launch_hold([Request("D", [9] * 40, SamplingParams(max_tokens=3))]) == \
        pytest.approx(hold)
