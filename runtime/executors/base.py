"""The Executor protocol: what every executor provides to the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvdeck.runtime.core.step_data import Conversion, SchedulerOutput, StepResult
from kvdeck.runtime.kv.groups import LayerGroups


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


@runtime_checkable
class Executor(Protocol):
    """Runs plans. Implementations: `sim` (a timing model), `torch` (a GGUF model).

    Errors: raise `errors.StepError` for a failure confined to one step (the step's
    requests fail, the engine continues); any other exception stops the engine.
    """

    name: str
    """Registry name: 'sim' or 'torch'."""
    model_name: str
    """Shown in the console and used in the prefix-cache namespace."""
    model_path: Path | None
    """The GGUF file the executor runs (its tokenizer comes from it); None for `sim`."""
    vocab_size: int
    """Token ids the executor produces and accepts are below this."""
    max_model_len: int
    """Context limit in tokens."""
    eos_token_ids: tuple[int, ...]
    virtual_time: bool
    """True when step times are modelled and the engine runs on a virtual clock."""
    computes_logits: bool
    """True when steps compute the model's logits: what logprobs, `best_of`, constrained
    output and scored prompts need (the sim executor models times and draws tokens)."""

    kv_formats: tuple[str, ...]
    """The KV formats this executor can store (the `kv_format` knob's choices)."""
    num_layers: int
    """Transformer layers (the `offload_layers` knob's bound)."""
    link_bandwidth: float
    """Bytes/s one way between device and host: measured at start-up (`executors/link.py`)
    or, for `sim`, the hardware profile's."""
    link_detail: str
    """Where `link_bandwidth` comes from, in a few words (shown beside it)."""
    offload_gain_bytes: int
    """Device bytes weight offload frees for the KV pool (offloaded − buffer bytes)."""
    draft_model_name: str
    """The draft model `speculative_method = draft` uses ("" without one)."""
    max_sequences: int
    """Most requests the executor can run at once (`max_num_seqs` may not exceed it)."""

    def kv_bytes_per_token(self, kv_format: str) -> int:
        """Bytes of K and V one token occupies across all layers in `kv_format`."""
        ...

    def draft_kv_bytes_per_token(self, kv_format: str) -> int:
        """Bytes of the draft model's KV per token (0 without one). Each block id also
        names a twin block of this size in the draft's pool, so the engine sizes the pool
        from the sum."""
        ...

    def estimate_draft_seconds(self, num_rows: int) -> float:
        """Predicted time of one draft-model pass over `num_rows` rows (draft length rule)."""
        ...

    def layer_groups(self) -> LayerGroups:
        """The model's full-attention and sliding-window layer groups, for `free_window_kv`
        (`kv/groups.py`); a ConfigError sentence when this executor or model cannot free
        window KV (no sliding-window layers, or KV the executor does not lay out itself)."""
        ...

    def bind_kv(self, num_blocks: int, block_size: int, kv_format: str,
                groups: LayerGroups | None = None) -> None:
        """Create (or size) the physical KV pool the block tables index into (and the draft
        model's twin pool, if any). With `groups` (from `layer_groups`) the pool is
        `num_blocks` *pages* of `groups.page_layers` layers each: plans then carry each
        chunk's local sub-group tables in `ScheduledChunk.window_tables`, copy-on-write
        pairs, transfers and `convert_kv` ids are page ids, and a local layer never reads
        a block before its window (−1 entries there). The draft model's twin pool stays
        indexed by the global table."""
        ...

    def bind_host_kv(self, num_blocks: int) -> None:
        """(Re)create the host tier's storage for `num_blocks` blocks in the pool's current
        format (0: none). Plans then carry `transfers` — block copies between the pool and
        the host tier — which `execute` performs first, in order, and reports."""
        ...

    def set_offload(self, num_layers: int, num_buffers: int) -> Conversion:
        """Keep the FFN weights of the last `num_layers` layers on the host, prefetched into
        `num_buffers` device buffers before each runs (0 layers: none); between iterations.
        Steps then report each prefetch in `StepResult.transfers`."""
        ...

    def describe_offload(self) -> str:
        """Weight offload in a line for the transfers panel ("" when none)."""
        ...

    def convert_kv(self, kv_format: str, num_blocks: int, src: list[int], dst: list[int]
                   ) -> Conversion:
        """Re-lay the pool as `num_blocks` blocks in `kv_format`, block `dst[i]` holding what
        block `src[i]` held (re-encoded); every other block's contents are dropped. Called
        between iterations when the `kv_format` knob changes."""
        ...

    def resolve_weight_formats(self, text: str, current: dict[str, str] | None = None
                               ) -> dict[str, str]:
        """The weight format per group (`attn`, `ffn`, `head`) a `weight_format` knob value
        names, `measured` resolved (ConfigError if this executor cannot take it)."""
        ...

    def set_weight_formats(self, formats: dict[str, str]) -> Conversion:
        """Re-pack (or re-price) the matrices of the groups whose format changes; returns
        the pause with the weight bytes before (`bytes_read`) and after (`bytes_written`)."""
        ...

    def describe_weights(self, kv_format: str) -> WeightsView:
        """What snapshots show of the weights (formats, bytes, measurements, quality)."""
        ...

    def auto_choice(self) -> str:
        """What `auto` weight groups used in the latest step ("" when none is `auto`)."""
        ...

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Perform the plan's tier transfers, then its copy-on-write copies, run the forward
        pass for every chunk, and sample a token for each chunk with `sample` set."""
        ...

    def propose(self, req, k: int, knobs) -> list[int]:
        """Up to `k` draft tokens to follow `req`'s last token under `knobs`'
        `speculative_method` (speculative decoding; a plan chunk then carries them in
        `draft` and `execute` returns the verified tokens in `StepResult.spec`). Not called
        under `draft`: a chunk then plans `num_draft` positions and `execute` drafts them
        with the draft model first, filling `draft`."""
        ...

    def estimate_step_seconds(self, num_new_tokens: int, num_pairs: int,
                              num_context_tokens: int) -> float:
        """Predicted time of a step with these totals (admission control, eviction value)."""
        ...

    def forget(self, request_id: str) -> None:
        """A request reached a final state: drop any per-request state kept for it."""
        ...

    def close(self) -> None:
        """Release devices, threads and memory."""
        ...
