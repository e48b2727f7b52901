"""llama-server's host prompt cache (`--cache-ram`), as far as the sim needs it: which slot
states it holds, so that a launch saves only the others (`ServerSlots.launch_hold`), and
which it drops past its limits, to be saved again when a slot holds them once more.

From llama-server's `server_prompt_cache` (tools/server), with the strict RAM limit of
llama.cpp's pull request 25070, which the benchmark's build has (its log says "prompt state
size … exceeds cache size limit …, skipping"):

- A state is a slot's tokens (its prompt and outputs, less the last sampled token, which
  never ran through the model) and their KV, of `state_bytes(tokens)` bytes.
- A state whose tokens begin one the cache holds is not saved ("prompt is already in the
  cache, skipping"), nor one larger than `--cache-ram` by itself. Saving one drops the
  states it begins with ("removing obsolete cached prompt"), then the oldest until it fits
  within `--cache-ram` (MiB; `CACHE_RAM_MIB` by default); the new state goes last.
- Then the oldest go while the states' tokens exceed the larger of the server's context
  (`-c`, all its slots') and what `--cache-ram` holds at their mean bytes per token; this
  may drop them all. `--cache-ram -1` lifts the byte limit (the context's tokens then bound
  the cache); `--cache-ram 0` turns the cache off, and the server saves nothing.

Not modelled: a launch that loads a cached state into its slot when the state shares more
of its prompt than the slot does (the sim's slots keep only their own last tokens), and
the checkpoints a state of a model with sliding-window layers carries besides its KV.
"""

from __future__ import annotations

from collections.abc import Callable

CACHE_RAM_MIB = 8192
"""llama-server's default `--cache-ram`."""


class PromptCache:
    """The states llama-server's prompt cache holds, oldest first."""

    def __init__(self, state_bytes: Callable[[int], float] = lambda n: 0.0,
                 cache_ram_mib: int = CACHE_RAM_MIB, context_tokens: int = 0):
        """`state_bytes`: a state of n tokens' bytes; `cache_ram_mib`: `--cache-ram`
        (below 0: no byte limit); `context_tokens`: the server's context, its token limit
        (0: none). A cache of `--cache-ram 0` is never made: the server saves nothing."""
        self.state_bytes = state_bytes
        self.limit_bytes = max(0, cache_ram_mib) << 20
        self.context_tokens = context_tokens
        self.states: list[tuple[tuple[int, ...], float]] = []
        """(tokens, bytes) of each state, oldest first."""

    def holds(self, tokens: tuple[int, ...]) -> bool:
        """Whether a state the cache holds begins with `tokens`."""
        n = len(tokens)
        return any(len(t) >= n and t[:n] == tokens for t, _ in self.states)

    def save(self, tokens: tuple[int, ...]) -> bool:
        """Save a state of `tokens`, unless one held begins with them or it alone exceeds
        the byte limit; returns whether it was saved (and the save took its time)."""
        size = self.state_bytes(len(tokens))
        if not tokens or self.holds(tokens) or (self.limit_bytes and size > self.limit_bytes):
            return False
        self.states = [(t, b) for t, b in self.states
                       if not (len(t) <= len(tokens) and tokens[:len(t)] == t)]
        if self.limit_bytes:  # room first, so that the cache never exceeds the limit
            held = sum(b for _, b in self.states)
            while self.states and held + size > self.limit_bytes:
                held -= self.states.pop(0)[1]
        self.states.append((tokens, size))
        self._trim_tokens()
        return True

    def _trim_tokens(self) -> None:
        """llama-server's `update` after a save: the byte limit holds already; the token
        limit is the context, raised to what the byte limit holds at the mean size."""
        if not self.context_tokens:
            return
        held = sum(len(t) for t, _ in self.states)
        limit = self.context_tokens
        if self.limit_bytes:
            mean = max(1.0, sum(b for _, b in self.states) / max(1, held))
            limit = max(limit, int(self.limit_bytes / mean))
        while self.states and held > limit:
            held -= len(self.states.pop(0)[0])
