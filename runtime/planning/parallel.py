"""Tensor parallelism in the step model: what splitting a model's layers across `tp` cards
adds to a step — an all-reduce after each layer's attention output and another after its
MLP (Megatron's layout), each over the cards' interconnect.

A ring all-reduce of `S` bytes over `N` cards moves `2(N − 1)/N · S` through each card's
link, so at a link bandwidth `B` it takes `2(N − 1)/N · S / B`; a step of `T` tokens reduces
`T × hidden × 2` bytes (bf16 activations) twice per layer. Chapter 002's example — a 70B
model of 80 layers on 2 cards — comes out of it (`profiles/scenarios/tp-allreduce.toml`):
the all-reduces of a step cost `layers ×` the per-layer time, about 8 ms over NVLink and
240 ms over PCIe.

A `Layout` (`tp × pp` cards) prices a whole step by the roofline across its cards
(`layout_step_seconds`) and says what the cards leave for KV (`Layout.kv_budget_bytes`); the
sim executor (`tensor_parallel`, `pipeline_parallel`) and the planner's layouts use it.
"""

from __future__ import annotations

from dataclasses import dataclass

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


LAYOUT_SIZES = (1, 2, 4, 8)
"""Tensor- and pipeline-parallel degrees a layout may take (cards in a node)."""


@dataclass(frozen=True)
class Layout:
    """How one replica spans cards: `tp` cards split every layer (Megatron's tensor split),
    `pp` stages of consecutive layers, `tp × pp` cards in all."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name, value in (("tensor_parallel", self.tp), ("pipeline_parallel", self.pp)):
            if value not in LAYOUT_SIZES:
                raise ConfigError(f"{name} must be one of "
                                  f"{', '.join(map(str, LAYOUT_SIZES))}, got {value!r}.")

    @property
    def cards(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return "TP1" if self.cards == 1 else \
            "×".join(x for x in (f"TP{self.tp}" if self.tp > 1 else "",
                                 f"PP{self.pp}" if self.pp > 1 else "") if x)

    def bubble(self, microbatches: int | None = None) -> float:
        """The share of a pipelined step its stages sit idle: `(pp − 1) / (m + pp − 1)`
        with `m` microbatches (one per stage by default, as the step model runs it)."""
        m = microbatches or self.pp
        return (self.pp - 1) / (m + self.pp - 1)

    def kv_budget_bytes(self, model: ModelProfile, hardware: HardwareProfile,
                        utilization: float = 0.9, reserve: int = 0) -> int:
        """What the cards leave for KV: `cards × memory × utilization` less the weights
        (split across them) and `reserve` bytes kept for other buffers (CUDA graphs' replay
        memory, `step_time.graph_reserve`); refuses a layout that cannot hold the model."""
        free = int(self.cards * hardware.memory_bytes * utilization) - model.weight_bytes \
            - reserve
        if free <= 0:
            raise ConfigError(
                f"{self.name} on {hardware.name} cannot hold {model.name}: its weights take "
                f"{model.weight_bytes / 1e9:,.0f} GB of the {self.cards} card(s)' "
                f"{self.cards * hardware.memory_bytes * utilization / 1e9:,.0f} GB at "
                f"{utilization:.0%} use; take more cards (tensor_parallel, "
                "pipeline_parallel).")
        return free


def layout_step_seconds(model: ModelProfile, hardware: HardwareProfile, layout: Layout,
                        weight_bytes: float, kv_bytes_per_token: float, num_new: int,
                        num_pairs: int, num_context: int) -> float:
    """One step of a replica laid out over `layout`'s cards, by the roofline: each card
    reads `1/(tp·pp)` of the weights and KV and computes `1/(tp·pp)` of the FLOPs; a
    pipeline runs the step as `m = min(pp, rows)` microbatches through `pp` stages,
    `m + pp − 1` stage times in all (its bubbles), each stage re-reading its weights per
    microbatch; every
    layer adds its all-reduces over the interconnect for its microbatch's tokens, and each
    stage boundary a send of the activations."""
    tp, pp = layout.tp, layout.pp
    m = max(1, min(pp, num_new))  # a microbatch holds at least one row
    share = 1.0 / (tp * pp)
    flops = (2.0 * model.matrix_params * num_new + 4.0 * num_pairs * model.num_heads
             * model.head_dim * model.num_layers) * share / m
    read = weight_bytes * share + num_context * kv_bytes_per_token * share / m
    stage = max(flops / (hardware.peak_flops * hardware.mfu),
                read / (hardware.bandwidth_bytes_per_s * hardware.mbu))
    tokens = -(-num_new // m)
    stage += model.num_layers / pp * allreduce_seconds_per_layer(model, tokens, tp, hardware)
    if pp > 1:
        link = hardware.interconnect_bandwidth_bytes_per_s or hardware.link_bandwidth_bytes_per_s
        stage += layer_message_bytes(model, tokens) / link
    return (m + pp - 1) * stage
