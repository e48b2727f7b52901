"""Disaggregated prefill and decode: what moving a prompt's KV from a prefill instance to a
decode instance costs (DistServe, Splitwise, Mooncake; vLLM's and SGLang's P/D).

The prefill instance computes the prompt (and a first token, which it throws away, as
vLLM's P/D proxy asks it for `max_tokens = 1`); the prompt's KV — `prompt tokens × KV bytes
per token` in the prefill instance's format — crosses the link; the decode instance takes
the request with all of the prompt but its last token already computed
(`Request.remote_kv_tokens`), computes that last token to get the first output token, and
decodes on. TTFT counts all of it from the request's arrival.

`layerwise` overlaps the copy with the prefill: each layer's KV leaves once that layer is
computed, so what is left after the prefill ends is the larger of the copy less all but the
last layer's compute and one layer's copy. `after` starts the copy when the prefill ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdeck.runtime.errors import ConfigError

TRANSFER_MODES = ("layerwise", "after")


@dataclass(frozen=True)
class Handoff:
    """One request's prompt KV on its way from a prefill to a decode instance."""

    index: int
    """The arrival it belongs to."""
    tokens: list[int]
    output_len: int
    arrival_s: float
    ready_s: float
    """When the KV is in on the decode side."""
    nbytes: int
    seconds: float
    """Transfer time not hidden behind the prefill."""
    prefill_replica: str
    cached_tokens: int
    """Prompt tokens the prefill instance found in its prefix cache."""


def transfer_seconds(nbytes: float, link_bytes_per_s: float, prefill_s: float,
                     num_layers: int, mode: str) -> float:
    """The copy's time left once the prefill ends (module docstring)."""
    if mode not in TRANSFER_MODES:
        raise ConfigError(f"kv_transfer must be one of {', '.join(TRANSFER_MODES)}, got "
                          f"{mode!r}.")
    if link_bytes_per_s <= 0:
        raise ConfigError("The KV link's bandwidth must be above 0 (--kv-link-bandwidth).")
    whole = nbytes / link_bytes_per_s
    if mode == "after":
        return whole
    layers = max(num_layers, 1)
    return max(whole - prefill_s * (layers - 1) / layers, whole / layers)
