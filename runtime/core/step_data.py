"""The data passed between the three calls of an engine iteration.

    plan   = scheduler.schedule()            # SchedulerOutput
    result = executor.execute(plan)          # StepResult
    events = scheduler.update(plan, result)

Data only: the scheduler builds plans, executors read them and return results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvdeck.runtime.core.request import Request

Estimator = Callable[[int, int, int], float]
"""(new tokens, causal pairs, context tokens) -> predicted step seconds: the timing model
the scheduler, its policies, the step budget and the forecast plan with."""


def causal_pairs(num_new: int, num_prior: int) -> int:
    """Query–key pairs when `num_new` tokens attend causally on top of `num_prior`:
    `c·h + c(c+1)/2` (docs/architecture.md, "Step time")."""
    return num_new * num_prior + num_new * (num_new + 1) // 2


def common_prefix(a, b) -> int:
    """How many tokens two token sequences have in common from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of an iteration: `num_new_tokens` tokens from position `start`."""

    request: Request
    num_new_tokens: int
    start: int
    """Position of the first new token; tokens before it are already in the KV cache."""
    block_table: list[int]
    """The request's block table as the KV manager holds it; executors must not modify it."""
    sample: bool
    """True when the chunk reaches the request's last known token, so a token is sampled."""
    draft: tuple[int, ...] = ()
    """Speculative draft tokens following the request's last token: the chunk then scores
    `1 + len(draft)` positions (its last token, then the draft) and the executor verifies
    the draft (`runtime/spec/verify.py`), returning the tokens to emit in `StepResult.spec`.
    A draft model's tokens are filled in by the executor at the start of the step (they
    cost part of it); a proposer without a model (n-gram) gives them at planning."""
    num_draft: int = 0
    """Draft positions this chunk verifies (`num_new_tokens = 1 + num_draft`); 0: not
    speculating."""
    emitted: int = 0
    """Set by the scheduler's update: tokens the request took from the step (0 or 1, up to
    `1 + len(draft)` when speculating)."""
    window_tables: list[list[int]] | None = None
    """With `free_window_kv` (`kv/groups.py`): the page table of each sliding-window
    sub-group, one page per block like `block_table` (which then holds the full-attention
    layers' pages), −1 where a block behind the window was freed. None: one group."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def branches(self) -> list:
        """The other samples of the prompt this chunk completes (`n` > 1): the executor
        draws each one's first token from this chunk's last logits row too (their own
        seeds, the same distribution), and the scheduler's update starts them."""
        r = self.request
        return r.branches if self.sample and not r.branched else []

    @property
    def num_pairs(self) -> int:
        return causal_pairs(self.num_new_tokens, self.start)

    def logits_rows(self, first: int = 0, count: int | None = None) -> int:
        """Rows through the output head among this chunk's tokens `first` to `first + count`
        (offsets into the chunk; all of them by default): every verified position of a
        draft, else the chunk's last token where it samples, once for each sample of the
        prompt (`branches`: they share the row but count one each). A prompt chunk that
        does not end its prompt computes no logits. `SimExecutor.execute` counts the same
        in its loop."""
        count = self.num_new_tokens - first if count is None else count
        if self.num_draft:
            return count
        return 1 + len(self.branches) if self.sample and first + count == self.num_new_tokens \
            else 0

    @property
    def prompt_scored(self) -> range:
        """Positions of this chunk whose logits the executor turns into prompt logprobs
        (`SamplingParams.prompt_logprobs`): position q's logits score prompt token q + 1, so
        the scored positions run to the prompt's second-to-last one. Positions scored
        before (a recompute after preemption) are not scored again. Empty for a request
        that scores no prompt."""
        scored = self.request.num_prompt_scored
        if scored is None:
            return range(0)
        return range(max(self.start, scored),
                     min(self.start + self.num_new_tokens, self.request.num_prompt_tokens - 1))


@dataclass(slots=True)
class SchedulerOutput:
    """One iteration's plan."""

    step: int
    time: float
    chunks: list[ScheduledChunk] = field(default_factory=list)
    cow_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) block copies to perform before the forward pass (pages, with
    `free_window_kv`: a page is copied in every slot)."""
    preempted: list[str] = field(default_factory=list)
    swapped: list[str] = field(default_factory=list)
    """Of `preempted`, those whose KV was swapped out to the host tier."""
    transfers: list[tuple[str, str, str, list[list[int]]]] = field(default_factory=list)
    """Copies between device and host to perform first, in this order: (kind, direction,
    what, [[src, dst], ...]) with kind `swap`/`demote`/`promote`, direction `d2h` (device
    block → host block) or `h2d` (see `kv/manager.py`)."""
    admitted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    token_budget: int = 0
    max_num_seqs: int = 0
    num_decode_tokens: int = 0
    """Kept by the scheduler as it adds chunks (summing per step would cost a pass each)."""
    num_prefill_tokens: int = 0
    speculative_method: str = "off"
    """The knob's value for this step: under `draft` an executor's draft model also keeps up
    with every chunk the target computes (so its KV is ready when a request drafts)."""
    limit: str | None = None
    """Why no more waiting requests joined this step (None: nobody was left waiting)."""
    itl_target_s: float = 0.0
    """The `itl_target_ms` knob in seconds (0: no target; `step_budget.py`)."""
    predicted_s: float = 0.0
    """The timing model's prediction of this step's compute time."""
    forecasts: dict[str, float] = field(default_factory=dict)
    """Admission control's latest predicted finish time of each running request, made
    when a request was admitted this step (`forecast.py`)."""

    @property
    def num_pairs(self) -> int:
        return sum(c.num_pairs for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class StepTiming:
    """What a step did and how long it took (modelled for `sim`, measured otherwise)."""

    seconds: float
    measured: bool
    num_prefill_tokens: int
    num_decode_tokens: int
    num_pairs: int
    bytes_read: int = 0
    """Weight and KV bytes the step read (modelled), for roofline comparisons."""
    padded_rows: int = 0
    """Rows the step ran beyond its tokens to fill an execution shape (a CUDA graph)."""


@dataclass(frozen=True)
class Conversion:
    """What re-encoding the KV pool (or re-packing weights) between iterations cost."""

    seconds: float
    measured: bool
    bytes_read: int
    bytes_written: int


@dataclass(slots=True)
class StepResult:
    """What an executor returns for one plan."""

    sampled: dict[str, int]
    """Request id -> sampled token, for every chunk with `sample` set."""
    timing: StepTiming
    errors: dict[str, str] = field(default_factory=dict)
    """Request id -> error message for requests the executor could not run."""
    logprobs: dict[str, object] = field(default_factory=dict)
    """Request id -> `sampling.TokenLogprobs` for requests that asked for logprobs."""
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    """Request id -> one `sampling.TokenLogprobs` per position of its chunk's
    `prompt_scored`, in order: the prompt token after each position."""
    transfers: list = field(default_factory=list)
    """`transfers.Transfer` per copy between device and host the step made (the plan's
    block copies and weight prefetches), with its timing."""
    draft_seconds: float = 0.0
    """Of the step's time, what a draft model spent drafting (measured or modelled)."""
    spec: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> the tokens a speculating chunk emits, in order: the accepted draft
    tokens, then the target's own token (a correction, or the bonus when all were accepted).
    Such a request has no entry in `sampled`."""
    attention: dict[str, list[float]] = field(default_factory=dict)
    """Request id -> the attention its rows put on each block of its table this step, in
    table order (softmax weights summed over heads, rows and layers): what heavy-hitter
    eviction ranks blocks by (`kv/eviction.py`). Empty unless the executor was asked."""
    lost_blocks: tuple[int, ...] = ()
    """Blocks whose KV the executor no longer has (llama.cpp recycled the slot that held
    them): the prefix cache must not hand them out again."""
