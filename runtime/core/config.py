"""Engine configuration (frozen, validated) and the live-tunable subset, `Knobs`.

Every bad value raises a `ConfigError` whose message names the field and what is allowed.
Knob changes are validated on submission (constructing a new `Knobs`), so an invalid change
never reaches the engine.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.eviction import Eviction
from kvdeck.runtime.kv.formats import KV_FORMATS
from kvdeck.runtime.models.weight_formats import parse_weight_format

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SCHEDULING_MODES = ("continuous", "static")
QUEUE_POLICIES = ("fcfs", "priority", "sjf", "edf")
RESERVATION_POLICIES = ("full", "lazy")
PREEMPTION_MODES = ("recompute", "swap", "auto")
"""Preempted requests recompute their KV when readmitted, swap it to the host tier and back,
or (`auto`) whichever the timing model says is faster for each victim (`policies/preemption.py`)."""
EVICTION_POLICIES = ("lru", "value")
DEADLINE_ACTIONS = ("reject", "wait")
SPECULATIVE_METHODS = ("off", "ngram", "draft")
"""Speculative decoding: off, or n-gram prompt lookup (`runtime/spec/`)."""
DRAFT_LENGTHS = ("adaptive", "fixed")
"""Draft length per request: chosen each step by the marginal-cost rule, or always the most."""
KNOB_CHOICES: dict[str, tuple[str, ...]] = {
    "scheduling": SCHEDULING_MODES, "queue_policy": QUEUE_POLICIES,
    "reservation": RESERVATION_POLICIES, "preemption": PREEMPTION_MODES,
    "eviction_policy": EVICTION_POLICIES, "on_deadline_miss": DEADLINE_ACTIONS,
    "kv_format": tuple(KV_FORMATS), "speculative_method": SPECULATIVE_METHODS,
    "draft_length": DRAFT_LENGTHS,
}
"""The knobs whose values are a fixed list, and the list."""


def check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be an integer from {lo:,} to {hi:,}, got {value!r}.")


def check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be a number from {lo:g} to {hi:g}, got {value!r}.")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}.")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}.")


def parse_cuts(text: str) -> tuple[int, ...]:
    """`prompt_cuts` as offsets, largest first: comma-separated token counts from 1 to
    1,048,576, each once; an empty text is none."""
    if not text.strip():
        return ()
    try:
        cuts = tuple(sorted((int(x) for x in text.split(",")), reverse=True))
    except ValueError:
        cuts = (0,)
    if any(not 1 <= c <= 1 << 20 for c in cuts) or len(set(cuts)) != len(cuts):
        raise ConfigError(f"prompt_cuts must be comma-separated token counts from 1 to "
                          f"1048576, each once, like 516,4; got {text!r}.")
    return cuts


@dataclass(frozen=True)
class Knobs:
    """Settings an operator may change while the engine runs (applied between iterations)."""

    max_num_batched_tokens: int = 2048
    """Token budget per iteration: decode tokens plus prefill-chunk tokens."""
    max_num_seqs: int = 256
    """Most requests in one iteration's batch."""
    chunk_size: int = 512
    """Most prompt tokens one request may prefill in one iteration."""
    scheduling: str = "continuous"
    queue_policy: str = "fcfs"
    sjf_max_wait_s: float = 30.0
    """Under `sjf`, a request that has waited this long goes ahead of shorter ones (aging)."""
    priority_max_wait_s: float = 30.0
    """Under `priority`, a request that has waited this long goes ahead of higher
    priorities, oldest first (aging), so a stream of high-priority arrivals cannot keep it
    out forever."""
    reservation: str = "lazy"
    preemption: str = "recompute"
    enable_prefix_caching: bool = True
    prefix_cache_capacity: int = 0
    """Most blocks the prefix cache may hold; 0 means bounded only by the pool."""
    prefix_wait: bool = True
    """A waiting request whose next uncached prompt block a running request is still
    prefilling waits for it to be cached rather than compute it again: a burst of requests
    with one new system prompt computes it once (SGLang's in-batch prefix caching)."""
    cache_admission_k: int = 1
    """Prefix-cache admission: 1 caches every completed block; k ≥ 2 caches a block only
    when its prefix was in the prompts of at least k of the last `cache_admission_window`
    admitted requests (`kv/cache_admission.py`)."""
    cache_admission_window: int = 1024
    """Admitted requests whose prompts count as sightings for `cache_admission_k`."""
    eviction_policy: str = "lru"
    admission_control: bool = False
    """Check a request's deadline against the executor's timing estimate before admitting."""
    on_deadline_miss: str = "reject"
    """What admission control does with a request that cannot meet its deadline."""
    kv_format: str = "fp16"
    """How the KV pool stores K and V (`kv/formats.py`). A change re-encodes the pool in
    place between iterations; the block count follows the budget (`core/switches.py`)."""
    weight_format: str = "dense"
    """Matrix weight formats, all groups or per group (`models/weight_formats.py`):
    `int8`, `attn=int8,ffn=int4,head=bf16`, `auto`, `measured`. Re-packed between
    iterations (`core/switches.py`); the engine stores the resolved value."""
    demote_prefixes: bool = True
    """With a host tier, evicted prefix-cache blocks are demoted to it instead of dropped
    (under `value`, only those whose host retention value is positive)."""
    offload_layers: int = 0
    """FFN weights of this many layers (the last ones) live in host memory and are copied
    into a device buffer before their layer runs; the bytes freed go to the KV pool."""
    offload_buffers: int = 2
    """Device buffers for offloaded layers: 1 serializes copy and compute, 2 overlap the
    copy of the next offloaded layer with the compute of this one."""
    speculative_method: str = "off"
    """Speculative decoding: `ngram` proposes the tokens that followed the latest match of
    the last tokens in the request's own context; `draft` has a smaller model with the same
    tokenizer (`--draft-model`) draft them in the step; the target verifies them in one
    pass."""
    num_speculative_tokens: int = 4
    """Most draft tokens proposed per request per step."""
    draft_length: str = "adaptive"
    """`adaptive`: per request and step, lengthen the draft only while the extra verify
    row's cost per expected extra token is below the step's cost per token (`ΔT/ΔN < T/N`,
    from the request's measured per-position acceptance); `fixed`: always the most."""
    prompt_lookup_max: int = 3
    """The n-gram proposer tries the last n tokens for n from this down to 1."""
    itl_target_ms: float = 0.0
    """Inter-token-latency target (0: off): each step's prefill chunks are sized so the
    timing model predicts the step within it (`step_budget.py`); max_num_batched_tokens
    and chunk_size still cap them."""

    def __post_init__(self) -> None:
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        check_int("max_num_seqs", self.max_num_seqs, 1, 1 << 16)
        check_int("chunk_size", self.chunk_size, 1, 1 << 20)
        for name, choices in KNOB_CHOICES.items():
            check_choice(name, getattr(self, name), choices)
        check_float("sjf_max_wait_s", self.sjf_max_wait_s, 0.0, 1e6)
        check_float("priority_max_wait_s", self.priority_max_wait_s, 0.0, 1e6)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_int("prefix_cache_capacity", self.prefix_cache_capacity, 0, 1 << 30)
        check_bool("prefix_wait", self.prefix_wait)
        check_int("cache_admission_k", self.cache_admission_k, 1, 1 << 10)
        check_int("cache_admission_window", self.cache_admission_window, 1, 1 << 24)
        check_bool("admission_control", self.admission_control)
        check_bool("demote_prefixes", self.demote_prefixes)
        check_int("offload_layers", self.offload_layers, 0, 1 << 12)
        check_int("offload_buffers", self.offload_buffers, 1, 2)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        check_int("prompt_lookup_max", self.prompt_lookup_max, 1, 16)
        check_float("itl_target_ms", self.itl_target_ms, 0.0, 1e6)
        parse_weight_format(self.weight_format)  # the syntax; the executor checks the rest

    def with_changes(self, **changes: Any) -> Knobs:
        """A validated copy with `changes` applied; unknown names raise a ConfigError."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            allowed = ", ".join(f.name for f in dataclasses.fields(self))
            raise ConfigError(f"Unknown knob {unknown[0]!r}; knobs are {allowed}.")
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EngineConfig:
    """Fixed settings of one engine instance."""

    block_size: int = 16
    """KV block size in tokens (1–256)."""
    kv_memory_bytes: int = 1 << 30
    """KV pool budget; divided by the model's KV bytes per block it sets the block count."""
    num_blocks: int | None = None
    """Overrides the block count derived from `kv_memory_bytes` (tests use tiny pools)."""
    host_kv_memory_bytes: int = 0
    """Host tier budget for swapped-out and demoted KV blocks (0: no host tier)."""
    free_window_kv: bool = False
    """Keep sliding-window layers' KV in blocks of their own and free those behind the
    window (`kv/groups.py`; torch executor, models mixing full and sliding-window layers,
    no host tier). `num_blocks` then counts pages."""
    kv_eviction: str = "off"
    """Token-level KV eviction for contexts past the pool (`kv/eviction.py`): off,
    sink-window or heavy-hitter. Lossy; torch executor, lazy reservation, no host tier, no
    free_window_kv."""
    kv_sink_tokens: int = 4
    """Tokens at the start of every request kept under eviction (rounded up to blocks)."""
    kv_recent_tokens: int = 512
    """Tokens before the next position kept under eviction."""
    kv_heavy_tokens: int = 256
    """Heavy-hitter eviction: tokens kept beyond the sinks and the recent window."""
    max_model_len: int | None = None
    """Context limit; None takes the executor's model context."""
    max_waiting: int = 4096
    """Waiting-queue bound; a full queue refuses new requests."""
    max_loras: int = 0
    """Most LoRA adapters resident at once, hence in one batch (vLLM's `--max-loras`); an
    adapter no running request uses is unloaded for another, loaded again from the host on
    demand (`runtime/models/lora.py`). 0: every adapter stays resident."""
    prompt_cuts: str = ""
    """Offsets before a prompt's end at which its prefill chunk ends, comma-separated (empty:
    none): llama-server ends a prompt's batch `4 + n_ubatch` and 4 tokens before its end on
    a model with sliding-window or recurrent layers, to checkpoint its state there
    (`policies/prompt_cuts.py`)."""
    seed: int = 0
    namespace: str = "default"
    """Prefix-cache namespace: model, adapter and KV format that make cached KV reusable."""
    knobs: Knobs = field(default_factory=Knobs)

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1, 256)
        check_int("kv_memory_bytes", self.kv_memory_bytes, 1, 1 << 50)
        check_int("host_kv_memory_bytes", self.host_kv_memory_bytes, 0, 1 << 50)
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1, 1 << 26)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2, 1 << 24)
        check_int("max_waiting", self.max_waiting, 1, 1 << 24)
        check_int("max_loras", self.max_loras, 0, 1 << 10)
        self.eviction.check(self.block_size)
        parse_cuts(self.prompt_cuts)
        check_int("seed", self.seed, 0, (1 << 63) - 1)

    @property
    def eviction(self) -> Eviction:
        return Eviction(self.kv_eviction, self.kv_sink_tokens, self.kv_recent_tokens,
                        self.kv_heavy_tokens)

    def blocks_for_budget(self, kv_bytes_per_token: int, extra_bytes: int = 0) -> int:
        """Blocks in the pool: the override, or the budget (plus `extra_bytes`, device
        memory freed by weight offload) divided by bytes per block."""
        if self.num_blocks is not None:
            return self.num_blocks
        n = (self.kv_memory_bytes + extra_bytes) // (self.block_size * kv_bytes_per_token)
        if n < 1:
            raise ConfigError(
                f"kv_memory_bytes {self.kv_memory_bytes:,} holds no block of {self.block_size} "
                f"tokens at {kv_bytes_per_token:,} bytes per token; raise the budget."
            )
        return int(n)

    def host_blocks(self, kv_bytes_per_token: int) -> int:
        """Blocks in the host tier: its budget divided by bytes per block."""
        return self.host_kv_memory_bytes // (self.block_size * kv_bytes_per_token)


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def split_settings(values: dict[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Split a flat settings dict by which dataclass owns each key; unknown keys are refused."""
    parts: list[dict[str, Any]] = [{} for _ in classes]
    for key, value in values.items():
        for part, cls in zip(parts, classes, strict=True):
            if key in field_names(cls) and key != "knobs":
                part[key] = value
                break
        else:
            allowed = sorted({n for c in classes for n in field_names(c)} - {"knobs"})
            raise ConfigError(
                f"Unknown setting {key!r}; allowed settings are {', '.join(allowed)}."
            )
    return parts


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML settings file as data, with a one-sentence error for a bad file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Config file {p} does not exist.")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"Config file {p} is not valid TOML: {e}.") from None
