"""llama-server's host prompt cache (`--cache-ram`), as far as the sim needs it: which slot
states it holds, so that a launch saves only the others (`ServerSlots.launch_hold`), and
which it drops past its limits, to be saved again when a slot holds them once more.

From llama-server's `server_prompt_cache` (tools/server):

- A state is a slot's tokens (its prompt and outputs, less the last sampled token, which
  never ran through the model) and their KV, of `state_bytes(tokens)` bytes.
- A state whose tokens begin one the cache holds is not saved ("prompt is already in the
  cache, skipping"); saving one drops the states it begins with ("removing obsolete cached
  prompt"). The new state goes last.
- Past its limits it drops the oldest states, always keeping one: first while their bytes
  exceed `--cache-ram` (MiB; 8,192 by default), then while their tokens exceed the larger
  of the server's context (`-c`) and what `--cache-ram` holds at the states' mean bytes
  per token. `--cache-ram -1` lifts the byte limit (the context's tokens then bound it);
  `--cache-ram 0` turns the cache off, and the server saves nothing.

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
        self.num_dropped = 0
        """States dropped past the limits."""

    def holds(self, tokens: tuple[int, ...]) -> bool:
        """Whether a state the cache holds begins with `tokens`."""
        n = len(tokens)
        return any(len(t) >= n and t[:n] == tokens for t, _ in self.states)

    def save(self, tokens: tuple[int, ...]) -> bool:
        """Save a state of `tokens`, unless one held begins with them; returns whether it
        was saved. States it begins with go, and past the limits the oldest."""
        if not tokens or self.holds(tokens):
            return False
        self.states = [(t, b) for t, b in self.states
                       if not (len(t) <= len(tokens) and tokens[:len(t)] == t)]
        self.states.append((tokens, self.state_bytes(len(tokens))))
        self._trim()
        return True

    def _trim(self) -> None:
        size = sum(b for _, b in self.states)
        if self.limit_bytes:
            while len(self.states) > 1 and size > self.limit_bytes:
                size -= self._drop()
        held = sum(len(t) for t, _ in self.states)
        limit = self.context_tokens
        if self.limit_bytes:  # the tokens --cache-ram holds at the states' mean size
            limit = max(limit, int(self.limit_bytes / max(1.0, size / max(1, held))))
        if self.context_tokens:
            while len(self.states) > 1 and held > limit:
                held -= len(self.states[0][0])
                self._drop()

    def _drop(self) -> float:
        """Drops the oldest state; returns its bytes."""
        self.num_dropped += 1
        return self.states.pop(0)[1]
