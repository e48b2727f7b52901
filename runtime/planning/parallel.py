"""Tensor parallelism in the step model: what splitting a model's layers across `tp` cards
adds to a step — an all-reduce after each layer's attention output and another after its
MLP (Megatron's layout), each over the cards' interconnect.

A ring all-reduce of `S` bytes over `N` cards moves `2(N − 1)/N · S` through each card's
link, so at a link bandwidth `B` it takes `2(N − 1)/N · S / B`; a step of `T` tokens reduces
`T × hidden × 2` bytes (bf16 activations) twice per layer. Chapter 002's example — a 70B
model of 80 layers on 2 cards — comes out of it (`profiles/scenarios/tp-allreduce.toml`):
the all-reduces of a step cost `layers ×` the per-layer time, about 8 ms over NVLink and
240 ms over PCIe.
"""

from __future__ import annotations

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile

ACTIVATION_BYTES = 2
"""Bytes per activation value reduced (bf16)."""
ALLREDUCES_PER_LAYER = 2
"""After the attention output projection and after the MLP (Megatron's tensor split)."""


def ring_allreduce_seconds(message_bytes: float, ranks: int, bandwidth: float) -> float:
    """A ring all-reduce of `message_bytes` over `ranks` cards on links of `bandwidth`
    bytes/s each: every card sends and receives `2(N − 1)/N` of the message."""
    if ranks < 1 or bandwidth <= 0:
        raise ConfigError(f"An all-reduce needs at least one card and a link bandwidth above "
                          f"0, got {ranks} cards and {bandwidth:g} B/s.")
    return 2 * (ranks - 1) / ranks * message_bytes / bandwidth


def layer_message_bytes(model: ModelProfile, tokens: int) -> int:
    """The activations one all-reduce of a layer reduces for a step of `tokens` tokens."""
    return tokens * model.num_heads * model.head_dim * ACTIVATION_BYTES


def allreduce_seconds_per_layer(model: ModelProfile, tokens: int, tp: int,
                                hardware: HardwareProfile) -> float:
    """What tensor parallelism over `tp` cards of `hardware` adds to each layer of a step."""
    if tp > 1 and hardware.interconnect_bandwidth_bytes_per_s <= 0:
        raise ConfigError(f"Hardware profile {hardware.name} names no card-to-card "
                          "interconnect ([interconnect] bandwidth_bytes_per_s): tensor "
                          "parallelism on it cannot be priced.")
    if tp == 1:
        return 0.0
    return ALLREDUCES_PER_LAYER * ring_allreduce_seconds(
        layer_message_bytes(model, tokens), tp, hardware.interconnect_bandwidth_bytes_per_s)


def allreduce_seconds_per_step(model: ModelProfile, tokens: int, tp: int,
                               hardware: HardwareProfile) -> float:
    """Every layer's all-reduces in a step of `tokens` tokens."""
    return model.num_layers * allreduce_seconds_per_layer(model, tokens, tp, hardware)
