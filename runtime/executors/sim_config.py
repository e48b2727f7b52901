"""The sim executor's settings (`SimConfig`): the simulated model and card, its step model,
and the serving engines' ways it can follow (llama-server's slots and prompt cache, a
modelled draft model, fault injection)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdeck.runtime.core.config import check_choice, check_float, check_int
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.server_prompt_cache import CACHE_RAM_MIB
from kvdeck.runtime.planning.parallel import Layout
from kvdeck.runtime.planning.step_time import parse_buckets

TIMING_MODES = ("auto", "measured", "fit", "roofline")
DRAFTING = ("sequential", "parallel")


@dataclass(frozen=True)
class SimConfig:
    """Settings of the sim executor (also accepted as keys of a run config file)."""

    model_profile: str = "qwen3-8b"
    hardware: str = "rtx-pro-6000"
    timing: str = "auto"
    """`measured`, `fit`, `roofline`, or `auto`: measured where the model profile has
    measured steps on `hardware` (and no fitted-model override is given), else the fit."""
    fixed_ms: float | None = None
    """Fitted-model overrides; when unset, the model profile's fit for `hardware` is used."""
    per_token_us: float | None = None
    per_pair_ns: float | None = None
    vocab_size: int = 32_000
    eos_probability: float = 0.0
    """Chance that any sampled token is end-of-sequence (0: requests run to max_tokens)."""
    eos_token_id: int = 2
    spec_acceptance: float = 0.7
    """Speculation what-ifs: the chance each draft token is accepted, given the ones before
    it were (a geometric acceptance profile)."""
    spec_acceptance_profile: str = ""
    """Per-position acceptance instead, comma-separated: `a_1,a_2,…` the chance draft token
    j is accepted given the ones before were (positions past the list take its last)."""
    draft_cost: float = 0.0
    """A modelled draft model (`speculative_method = draft`): one draft pass costs this
    fraction of a target step over the same rows (0: no draft model)."""
    draft_kv_ratio: float = 0.0
    """The modelled draft's KV bytes per token as a fraction of the target's (its twin
    blocks take pool memory)."""
    drafting: str = "sequential"
    """`sequential`: k draft passes per step, each one token per speculating request;
    `parallel`: one pass drafts all k positions (a parallel-draft network)."""
    graph_buckets: str = ""
    """Execution shapes: CUDA-graph batch sizes, comma-separated (empty: none). A step of at
    most the largest runs padded to the next one, and the padding rows are priced. The
    torch executor takes it too: on CUDA its decode steps replay graphs of these sizes."""
    tensor_parallel: int = 1
    """Cards each layer is split across (an all-reduce per layer over the interconnect)."""
    pipeline_parallel: int = 1
    """Pipeline stages of consecutive layers, a card (or `tensor_parallel` cards) each."""
    memory_utilization: float = 0.0
    """Above 0: the KV budget is what the layout's cards leave at this share of their
    memory, less the weights (vLLM's `--gpu-memory-utilization`), instead of
    `kv_memory_bytes`."""
    server_slots: int = 0
    """Above 0: price steps as llama-server with this many slots (`-np`, KV per slot) runs
    them: a pass per micro-batch llama.cpp cuts a batch into, each a run of neighbouring
    slots (`server_slots.py`)."""
    server_cache_ram_mib: int = CACHE_RAM_MIB
    """Under `server_slots`: llama-server's `--cache-ram` in MiB, its prompt cache's byte
    limit (0: no prompt cache, no saves; -1: no byte limit; `server_prompt_cache.py`)."""
    server_context_tokens: int = 0
    """Under `server_slots`: llama-server's context (`-c`, all slots'), its prompt cache's
    token limit (0: the sim's KV pool's tokens)."""
    prompt_pass: bool = False
    """Price a step of prompt chunks and decode rows as llama.cpp runs it: a pass of the
    decode rows, then one of the prompt chunks (`server_slots.pass_seconds`), each
    corrected by the measured steps of its shape, instead of one fitted step and the fit's
    mixed term. `server_slots` prices such a step by its micro-batches instead."""
    fail_at_step: int | None = None
    """Fault injection: the executor fails for good (as a lost device would) on its n-th
    executed step, so clients, dashboards and the console can be tested against a dying
    engine."""

    def __post_init__(self) -> None:
        check_choice("timing", self.timing, TIMING_MODES)
        for name in ("fixed_ms", "per_token_us", "per_pair_ns"):
            value = getattr(self, name)
            if value is not None:
                check_float(name, value, 0.0, 1e9)
        check_int("vocab_size", self.vocab_size, 2, 1 << 24)
        check_float("eos_probability", self.eos_probability, 0.0, 1.0)
        check_float("spec_acceptance", self.spec_acceptance, 0.0, 1.0)
        self.acceptance_profile()  # refuses a malformed list
        check_float("draft_cost", self.draft_cost, 0.0, 100.0)
        check_float("draft_kv_ratio", self.draft_kv_ratio, 0.0, 100.0)
        check_choice("drafting", self.drafting, DRAFTING)
        parse_buckets(self.graph_buckets)
        check_float("memory_utilization", self.memory_utilization, 0.0, 1.0)
        check_int("server_slots", self.server_slots, 0, 4096)
        check_int("server_cache_ram_mib", self.server_cache_ram_mib, -1, 1 << 30)
        check_int("server_context_tokens", self.server_context_tokens, 0, 1 << 30)
        layout = Layout(self.tensor_parallel, self.pipeline_parallel)
        if layout.cards > 1 and self.timing in ("measured", "fit"):
            raise ConfigError(f"{layout.name} is priced by the roofline across its cards (a "
                              f"{self.timing} step model is one card's); use timing = "
                              "'roofline' or 'auto'.")
        if not self.draft_cost and (self.drafting != "sequential" or self.draft_kv_ratio):
            raise ConfigError("drafting and draft_kv_ratio describe a modelled draft model; "
                              "give it a cost with --draft-cost C too.")
        check_int("eos_token_id", self.eos_token_id, 0, self.vocab_size - 1)
        if self.fail_at_step is not None:
            check_int("fail_at_step", self.fail_at_step, 1, 1 << 40)

    def acceptance_profile(self) -> tuple[float, ...]:
        """Conditional acceptance per draft position (one entry: every position)."""
        text = self.spec_acceptance_profile.strip()
        if not text:
            return (self.spec_acceptance,)
        try:
            values = tuple(float(x) for x in text.split(","))
        except ValueError:
            values = (-1.0,)
        if not values or any(not 0.0 <= v <= 1.0 for v in values):
            raise ConfigError(f"spec_acceptance_profile must be comma-separated chances from 0 "
                              f"to 1, like 0.9,0.8,0.7; got {text!r}.")
        return values
