"""The executor contract: a small core protocol every executor provides (`Executor`), the
frozen facts about it (`ExecutorInfo`), and the capabilities only some have (KV
conversion, a host tier, weight formats, offload, a draft model, window groups, a hold
before taking requests in), each a protocol of its own that callers test for instead of an
executor's name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from kvdeck.runtime.core.step_data import Conversion, SchedulerOutput, StepResult
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.models.weight_formats import GROUPS

if TYPE_CHECKING:
    from kvdeck.runtime.core.request import Request
    from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile, StepFit

C = TypeVar("C")


@dataclass(frozen=True)
class WeightsView:
    """The executor's matrix weights: formats, bytes, the kernel measurements behind the
    choice, and cached quality figures of the current formats (`runtime/text/quality.py`)."""

    formats: str
    """The `weight_format` knob's resolved value."""
    resident_bytes: int
    detail: str = ""
    """How quantized formats run here (activation dtype, group sizes)."""
    kernels: tuple[str, ...] = ()
    """The start-up micro-benchmark's figures (`kernels.describe`); empty if not measured."""
    quality: tuple[tuple[str, str], ...] = ()
    """(knob, figure) for the current weight and KV formats whose quality is cached."""
    auto: str = ""
    """What `auto` groups used in the latest step, e.g. `head=int8`."""
    adapters: str = ""
    """LoRA adapters resident and served, with their bytes (`Adapters.describe_adapters`);
    empty without any."""


@dataclass(frozen=True)
class ExecutorInfo:
    """What an executor is and can do, fixed when it is built (an executor replaces it
    whole when a fact changes, as llama.cpp's context limit does when its pool is bound)."""

    name: str
    """Registry name: 'sim', 'torch' or 'llama_cpp' (shown, recorded; never branched on)."""
    model_name: str
    """Shown in the console and used in the prefix-cache namespace."""
    model_path: Path | None
    """The GGUF file the executor runs (its tokenizer comes from it); None for `sim`."""
    vocab_size: int
    """Token ids the executor produces and accepts are below this."""
    max_model_len: int
    """Context limit in tokens."""
    eos_token_ids: tuple[int, ...]
    num_layers: int
    """Transformer layers (the `offload_layers` knob's bound)."""
    kv_formats: tuple[str, ...]
    """The KV formats this executor can store (the `kv_format` knob's choices)."""
    link_bandwidth: float
    """Bytes/s one way between device and host: measured at start-up (`executors/link.py`)
    or, for `sim`, the hardware profile's."""
    link_detail: str
    """Where `link_bandwidth` comes from, in a few words (shown beside it)."""
    virtual_time: bool = False
    """True when step times are modelled and the engine runs on a virtual clock."""
    computes_logits: bool = True
    """True when steps compute the model's logits: what logprobs, `best_of`, constrained
    output and scored prompts need (the sim executor models times and draws tokens)."""
    max_sequences: int = 1 << 30
    """Most requests the executor can run at once (`max_num_seqs` may not exceed it)."""
    slots: int = 0
    """Streams the KV pool is split into evenly (llama.cpp's `n_parallel`; 0: one pool),
    which is why a request's context is the pool over the slots."""
    draft_model_name: str = ""
    """The draft model `speculative_method = draft` uses ("" without one)."""
    start_note: str = ""
    """A line for the start-up banner when the executor runs in other than its fastest
    mode (e.g. llama.cpp without re-packed weights, and why)."""
    device: str = "cpu"
    """Where steps run, as torch names devices ('cpu', 'cuda:0', 'mps'); 'gpu' for llama.cpp
    with layers on a GPU; 'none' for the sim, which runs none."""


@runtime_checkable
class Executor(Protocol):
    """Runs plans: the core every executor provides. Implementations: `sim` (a timing
    model), `torch` (a GGUF model in PyTorch), `llama_cpp` (llama.cpp's kernels). What
    only some executors can do is in the capability protocols below; callers test for one
    with `isinstance` (or `capability`, which refuses with a sentence).

    Errors: raise `errors.StepError` for a failure confined to one step (the step's
    requests fail, the engine continues); any other exception stops the engine.
    """

    info: ExecutorInfo

    def kv_bytes_per_token(self, kv_format: str) -> int:
        """Bytes of K and V one token occupies across all layers in `kv_format`
        (ConfigError for a format this executor cannot store)."""
        ...

    def bind_kv(self, num_blocks: int, block_size: int, kv_format: str,
                groups: LayerGroups | None = None) -> None:
        """Create (or size) the physical KV pool the block tables index into (and the draft
        model's twin pool, if any). With `groups` (from `WindowGroups.layer_groups`) the
        pool is `num_blocks` *pages* of `groups.page_layers` layers each: plans then carry
        each chunk's local sub-group tables in `ScheduledChunk.window_tables`, copy-on-write
        pairs, transfers and `convert_kv` ids are page ids, and a local layer never reads
        a block before its window (−1 entries there). The draft model's twin pool stays
        indexed by the global table."""
        ...

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Perform the plan's tier transfers, then its copy-on-write copies, run the forward
        pass for every chunk, and sample a token for each chunk with `sample` set."""
        ...

    def estimate_step_seconds(self, num_new_tokens: int, num_pairs: int,
                              num_context_tokens: int) -> float:
        """Predicted time of a step with these totals (admission control, eviction value)."""
        ...

    def propose(self, req, k: int, knobs) -> list[int]:
        """Up to `k` draft tokens to follow `req`'s last token under `knobs`'
        `speculative_method` (speculative decoding; a plan chunk then carries them in
        `draft` and `execute` returns the verified tokens in `StepResult.spec`). Not called
        under `draft`: a chunk then plans `num_draft` positions and `execute` drafts them
        with the draft model first, filling `draft`."""
        ...

    def describe_weights(self, kv_format: str) -> WeightsView:
        """What snapshots show of the weights (formats, bytes, measurements, quality)."""
        ...

    def forget(self, request_id: str) -> None:
        """A request reached a final state: drop any per-request state kept for it."""
        ...

    def close(self) -> None:
        """Release devices, threads and memory."""
        ...


# -- capabilities ---------------------------------------------------------------------------


@runtime_checkable
class KVConversion(Protocol):
    """Re-lays the KV pool in another format while requests keep their KV."""

    def convert_kv(self, kv_format: str, num_blocks: int, src: list[int], dst: list[int]
                   ) -> Conversion:
        """Re-lay the pool as `num_blocks` blocks in `kv_format`, block `dst[i]` holding what
        block `src[i]` held (re-encoded); every other block's contents are dropped. Called
        between iterations when the `kv_format` knob changes."""
        ...


@runtime_checkable
class HostTier(Protocol):
    """Keeps KV blocks in host memory and copies them over the link (swap, demotion)."""

    def bind_host_kv(self, num_blocks: int) -> None:
        """(Re)create the host tier's storage for `num_blocks` blocks in the pool's current
        format (0: none). Plans then carry `transfers` — block copies between the pool and
        the host tier — which `execute` performs first, in order, and reports."""
        ...


@runtime_checkable
class WeightFormats(Protocol):
    """Re-packs its matrices into other formats live (the `weight_format` knob)."""

    weight_formats: dict[str, str]
    """The weight format of each group (`attn`, `ffn`, `head`) now."""

    def resolve_weight_formats(self, text: str, current: dict[str, str] | None = None
                               ) -> dict[str, str]:
        """The weight format per group a `weight_format` knob value names, `measured`
        resolved (ConfigError if this executor cannot take it)."""
        ...

    def set_weight_formats(self, formats: dict[str, str]) -> Conversion:
        """Re-pack (or re-price) the matrices of the groups whose format changes; returns
        the pause with the weight bytes before (`bytes_read`) and after (`bytes_written`)."""
        ...

    def auto_choice(self) -> str:
        """What `auto` weight groups used in the latest step ("" when none is `auto`)."""
        ...


@runtime_checkable
class Offload(Protocol):
    """Keeps some layers' FFN weights on the host, prefetched before each runs."""

    offload_gain_bytes: int
    """Device bytes weight offload frees for the KV pool (offloaded − buffer bytes)."""

    def set_offload(self, num_layers: int, num_buffers: int) -> Conversion:
        """Keep the FFN weights of the last `num_layers` layers on the host, prefetched into
        `num_buffers` device buffers before each runs (0 layers: none); between iterations.
        Steps then report each prefetch in `StepResult.transfers`."""
        ...

    def describe_offload(self) -> str:
        """Weight offload in a line for the transfers panel ("" when none)."""
        ...


@runtime_checkable
class Drafting(Protocol):
    """Can run a draft model beside the target (`speculative_method = draft`); an
    instance built without one answers 0 to both."""

    def draft_kv_bytes_per_token(self, kv_format: str) -> int:
        """Bytes of the draft model's KV per token (0 without one). Each block id also
        names a twin block of this size in the draft's pool, so the engine sizes the pool
        from the sum."""
        ...

    def estimate_draft_seconds(self, num_rows: int) -> float:
        """Predicted time of one draft-model pass over `num_rows` rows (draft length rule)."""
        ...


@runtime_checkable
class WindowGroups(Protocol):
    """Lays out its own KV pages, so sliding-window layers can free blocks behind their
    window (`free_window_kv`)."""

    def layer_groups(self) -> LayerGroups:
        """The model's full-attention and sliding-window layer groups (`kv/groups.py`); a
        ConfigError sentence when the model has no sliding-window layers."""
        ...


@runtime_checkable
class StepCost(Protocol):
    """Prices its steps with a step-time model over the matrix bytes each step reads (the
    planner's live view reads both)."""

    fit: StepFit
    """The step-time model now: the profile's (sim) or learned from measured steps
    (`online_fit.py`)."""
    weight_bytes: int
    """Matrix bytes every step reads in the current weight formats."""


@runtime_checkable
class LaunchHold(Protocol):
    """Holds its loop before a step that takes new requests in (the sim as llama-server,
    which first saves its idle slots to its prompt cache: `server_slots.py`)."""

    holds: bool
    """Whether it ever holds (the sim: behind llama-server's slots, with their saves
    timed)."""

    def launch_hold(self, waiting: Sequence[Request]) -> float:
        """Seconds the loop holds before planning a step in which `waiting` may start (0:
        none); requests that arrive meanwhile are planned in that step too."""
        ...


@runtime_checkable
class Modelled(Protocol):
    """Runs on a hardware and a model profile instead of a model (the sim); the planner
    takes them as they are."""

    hardware: HardwareProfile
    model: ModelProfile


@runtime_checkable
class Adapters(Protocol):
    """Applies LoRA adapters per row inside a batch (`runtime/models/lora.py`)."""

    def load_adapter(self, name: str, path: str | Path, max_loras: int = 0) -> int:
        """Serve the adapter at `path` as `name`, at most `max_loras` resident at once (0:
        all); its bytes. ConfigError when it does not fit the model."""
        ...

    def describe_adapters(self) -> str:
        """e.g. 'LoRA 1/3 resident · 0.7 of 1.4 MiB' (empty without adapters)."""
        ...

    @property
    def adapter_reserve_bytes(self) -> int:
        """Device bytes the adapters' slots can take at most, taken from the KV budget."""
        ...


@runtime_checkable
class TokenEviction(Protocol):
    """Reads block tables with holes (token-level KV eviction, `kv/eviction.py`) and can
    report the attention each row puts on each block it reads (`StepResult.attention`)."""

    def set_token_eviction(self, mode: str) -> None:
        """Read tables with holes unless `mode` is 'off'; with 'heavy-hitter', report the
        attention on each block with every step."""
        ...


NEEDS = {KVConversion: "re-encodes its KV pool in place", HostTier: "has a host KV tier",
         Adapters: "applies LoRA adapters (the torch and llama_cpp executors)",
         WeightFormats: "re-packs its weights", Offload: "offloads FFN weights to the host",
         Drafting: "runs a draft model",
         WindowGroups: "lays out KV pages of its own (the torch executor)",
         TokenEviction: "reads block tables with evicted holes (the torch executor)"}
"""What each capability is, as the refusal sentence says it."""


def capability(executor: Executor, kind: type[C], what: str) -> C:
    """`executor` as a `kind`, or a ConfigError saying that `what` (a knob or flag) needs
    an executor that has it."""
    if not has(executor, kind):
        raise ConfigError(f"{what} needs an executor that {NEEDS[kind]}; the "
                          f"{executor.info.name} executor does not.")
    return executor


_HAS: dict[tuple[type, type], bool] = {}


def has(executor: Executor, kind: type) -> bool:
    """`isinstance(executor, kind)`, remembered per class: a capability belongs to an
    executor's class, and a protocol's isinstance reads every member (4–9 µs on a 2-core
    CPU), which snapshots would pay several times a build."""
    key = (type(executor), kind)
    hit = _HAS.get(key)
    if hit is None:
        hit = _HAS[key] = isinstance(executor, kind)
    return hit


def draft_kv_bytes_per_token(executor: Executor, kv_format: str) -> int:
    """The draft model's twin KV per token; 0 without one."""
    return executor.draft_kv_bytes_per_token(kv_format) if has(executor, Drafting) else 0


def offload_of(executor: Executor) -> tuple[str, int]:
    """(weight offload in a line, device bytes it frees); ("", 0) without offload."""
    if not has(executor, Offload):
        return "", 0
    return executor.describe_offload(), executor.offload_gain_bytes


def auto_choice(executor: Executor) -> str:
    """What `auto` weight groups used in the latest step ("" when none, or no formats)."""
    return executor.auto_choice() if has(executor, WeightFormats) else ""


def resolve_weight_formats(executor: Executor, text: str,
                           current: dict[str, str] | None = None) -> dict[str, str]:
    """The formats per group a `weight_format` value names for `executor`; one that does
    not re-pack weights takes only `dense` (its own) or `measured` (which picks it)."""
    if isinstance(executor, WeightFormats):
        return executor.resolve_weight_formats(text, current)
    if text.strip() in ("dense", "measured"):  # the weights as the model file has them
        return {g: "dense" for g in GROUPS}
    raise ConfigError(f"weight_format {text!r}: the {executor.info.name} executor runs the "
                      "model file's own weights (weight_format dense); re-packing them needs "
                      "an executor that does (the torch executor).")
