"""The Executor protocol: what every executor provides to the engine."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from runtime.plan import SchedulerOutput, StepResult


@runtime_checkable
class Executor(Protocol):
    """Runs plans. Implementations: `sim` (this package), `torch`, `llama_cpp`."""

    name: str
    """Registry name: 'sim', 'torch' or 'llama_cpp'."""
    model_name: str
    """Shown in the console and used in the prefix-cache namespace."""
    max_model_len: int
    """Context limit in tokens."""
    eos_token_ids: tuple[int, ...]
    virtual_time: bool
    """True when step times are modelled and the engine runs on a virtual clock."""

    def kv_bytes_per_token(self, kv_format: str) -> int:
        """Bytes of K and V one token occupies across all layers in `kv_format`."""
        ...

    def bind_kv(self, num_blocks: int, block_size: int, kv_format: str) -> None:
        """Create (or size) the physical KV pool the block tables index into."""
        ...

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Perform the plan's copy-on-write copies, run the forward pass for every chunk,
        and sample a token for each chunk with `sample` set."""
        ...

    def estimate_step_seconds(self, num_new_tokens: int, num_pairs: int,
                              num_context_tokens: int) -> float:
        """Predicted time of a step with these totals (admission control, eviction value)."""
        ...

    def close(self) -> None:
        """Release devices, threads and memory."""
        ...
