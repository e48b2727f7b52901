"""Requests, their sampling parameters and their lifecycle states — plain dataclasses."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvdeck.runtime.errors import ConfigError

if TYPE_CHECKING:
    from kvdeck.runtime.text.checks import AnswerCheck
    from kvdeck.runtime.text.guided import Guide, GuideSpec


class RequestStatus(enum.Enum):
    """Where a request is in its life. The last four are final."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    """Evicted from the batch with its KV freed; waits at the head of the queue to recompute."""
    SWAPPED = "swapped"
    """Evicted from the batch with its computed KV copied to the host tier; waits at the head
    of the queue to be copied back and continue."""
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    ABORTED = "aborted"
    REJECTED = "rejected"

    @property
    def is_finished(self) -> bool:
        return self in _FINAL


_FINAL = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
          RequestStatus.ABORTED, RequestStatus.REJECTED}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens and when to stop. Validated on construction."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    """Report each output token's log-probability and this many alternatives (None: off)."""
    prompt_logprobs: int | None = None
    """Score the prompt too (vLLM's name): every prompt token after the first gets its
    log-probability given the tokens before it, and this many alternatives (None: off).
    Such a request reuses no cached prefix it has not scored itself."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence in the output (OpenAI's)."""
    repetition_penalty: float = 1.0
    """Divides positive and multiplies negative logits of tokens in the prompt or output
    (vLLM's, after Keskar et al.); 1 is off."""
    min_p: float = 0.0
    """Drop tokens less likely than `min_p` × the most likely one (after temperature)."""
    min_tokens: int = 0
    """End-of-sequence and `stop_token_ids` are masked until this many tokens are out."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits (OpenAI's, −100 to 100)."""
    guide: GuideSpec | None = None
    """An output constraint (JSON schema, regex, choices, grammar): `runtime/text/guided.py`."""
    lora: str | None = None
    """The LoRA adapter the request runs with (a name the executor loaded), or None: the
    base model. Its prefix-cache blocks are its adapter's own (`KVState.namespace_of`)."""

    @property
    def processes_logits(self) -> bool:
        """Penalties, a bias, `min_p` or `min_tokens` change the logits before a token is
        picked: such a request takes the full sampler (no greedy shortcut, no draft)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_p or self.min_tokens)

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ConfigError(f"temperature must be between 0 and 100, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be greater than 0 and at most 1, got {self.top_p}.")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be 0 (off) or a positive integer, got {self.top_k}.")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ConfigError(f"logprobs must be between 0 and 20, got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ConfigError("prompt_logprobs must be between 0 and 20, got "
                              f"{self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be from -2 to 2, got {getattr(self, name)}.")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ConfigError("repetition_penalty must be greater than 0 and at most 10 (1 is "
                              f"off), got {self.repetition_penalty}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be from 0 to 1, got {self.min_p}.")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be from 0 to max_tokens ({self.max_tokens}), "
                              f"got {self.min_tokens}.")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ConfigError("logit_bias maps token ids (0 or more) to biases from -100 "
                                  f"to 100, got {token}: {bias}.")


@dataclass(slots=True)
class Occupancy:
    """The accelerator time a request occupied, as chapter 000 counts it: each step's time is
    shared among its rows by the tokens each computed, so a batch's occupancy counts once,
    and `t_GPU = L/r_P + (G − 1)/r_D` for the request."""

    prefill_s: float = 0.0
    """Seconds charged to its prefill chunks (recomputation included)."""
    prefill_new: int = 0
    """Tokens those chunks computed (the `L` of `L/r_P`)."""
    decode_s: float = 0.0
    """Seconds charged to its decode calls (a speculating call: all its rows)."""
    decode_calls: int = 0
    """Decode calls it took part in (one per step that fed it one known token)."""

    def charge(self, num_prompt: int, start: int, n: int, draft: int, per_token: float) -> None:
        """Charge one plan row (`n` tokens from `start`, `draft` of them drafts) its share of
        a step that cost `per_token` seconds per token computed. (`Scheduler.update` inlines
        this rule, its loop runs per row: keep the two alike; the replay parity tests hold
        them equal.)"""
        if n - draft == 1 and start >= num_prompt:
            self.decode_s += n * per_token
            self.decode_calls += 1
        else:
            self.prefill_s += n * per_token
            self.prefill_new += n

    def values(self) -> tuple[float, int, float, int]:
        return self.prefill_s, self.prefill_new, self.decode_s, self.decode_calls

    @property
    def seconds(self) -> float:
        """`t_GPU`: all the accelerator seconds it occupied."""
        return self.prefill_s + self.decode_s


@dataclass(eq=False, kw_only=True, slots=True)
class Progress:
    """Where a request is and what happened to it, in engine-clock times — the part of a
    request an iteration trace also knows, so a live `Request` and a replayed
    `checkpoint.RequestState` share it (and `metrics.request_metrics` reads either)."""

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (computed or reused from the prefix cache)."""
    num_cached_tokens: int = 0
    """Prompt tokens reused from the prefix cache at the last admission."""
    admitted_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    reason: str | None = None
    """Why the request was rejected or aborted, or what stopped it."""
    num_preemptions: int = 0
    predicted_finish: float | None = None
    """Admission control's latest forecast of the finish time, made when it or a later
    request was admitted (`runtime/core/forecast.py`); None without admission control."""
    correct: bool | None = None
    """Whether the finished answer passed the request's check (`runtime/text/checks.py`); None
    when it carried none or did not finish with an answer."""
    occupancy: Occupancy = field(default_factory=Occupancy)
    """Accelerator time it occupied so far."""


@dataclass(eq=False, slots=True)
class Request(Progress):
    """One generation request and everything that happened to it.

    Times are on the engine clock (virtual seconds under the sim executor). `arrival_time`
    is the scheduled arrival when the request comes from a trace, so queueing outside the
    engine counts towards TTFT.

    Slotted, like `Progress`: with an instance dict, CPython 3.11 shares the dict's keys
    between instances only below 30 attributes, and past that every attribute access of
    every request slows down (measured: one field more made an engine iteration at 1,024
    running requests 18 % slower). Slots have no such limit.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    deadline: float | None = None
    """Absolute completion deadline on the engine clock, or None."""
    intake_time: float | None = None
    """When the engine takes it in, where later than its arrival (a sim fitted from outside a
    server models the request's way through HTTP); its TTFT still counts from arrival."""
    priority: int = 0
    """Lower runs first under the `priority` policy (as in vLLM)."""
    remote_kv_tokens: int = 0
    """Prompt tokens whose KV was computed outside the prefix cache: by another instance,
    which sent it (disaggregated prefill, `runtime/cluster/`), or kept by the llama-server
    slot the sim gives the request (`--server-slots`, set on admission). Admission takes
    them as computed and cached, in fresh blocks, as vLLM's KV connectors do; a preemption
    loses them (0 after that admission)."""
    num_arrival_preemptions: int = 0
    """Times a higher-priority arrival preempted it (bounded:
    `policies.preemption.ARRIVAL_PREEMPTIONS`)."""
    output_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    events: list[tuple[float, str]] = field(default_factory=list)
    """What happened to the request, in engine time: arrival, admissions, prefill chunks,
    preemptions, first token, finish (the console's request detail shows them)."""
    detokenizer: object | None = None
    """A `tokenizer.IncrementalDetokenizer` when the engine has a tokenizer."""
    output_logprobs: list = field(default_factory=list)
    """One `sampling.TokenLogprobs` per output token when `sampling.logprobs` is set."""
    prompt_logprobs_out: list = field(default_factory=list)
    """With `sampling.prompt_logprobs`: one `sampling.TokenLogprobs` per prompt token from
    the second on, in order, as the prefill scores them (entry i is token i + 1's)."""
    tracked: bool = False
    """Snapshots carry this request's text (the console's prompt follows it)."""
    guide: Guide | None = None
    """Its grammar state while it follows `sampling.guide` (the engine starts it)."""
    check: AnswerCheck | None = None
    """What the answer must satisfy to count as correct (sets `correct` at the finish)."""
    branches: list[Request] = field(default_factory=list)
    """The other samples of this prompt (`n` > 1): made with the request, started sharing
    its prompt's blocks when the prompt is computed (`Scheduler._start_branches`)."""
    branched: bool = False
    """Its branches have started (or there were none to start)."""
    block_keys: list[tuple[int, ...]] = field(default_factory=list)
    """Its full blocks' tokens as tuples (the prefix tree's keys), each made once by
    `keys_of`: tokens are only ever appended, so a block's key never changes."""
    block_keys_size: int = 0
    """The block size `block_keys` were cut at."""
    matched: list = field(default_factory=list)
    """The prefix-tree nodes its latest lookup matched (`PrefixTree.match` goes on from
    them rather than from the root)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ConfigError(f"Request {self.request_id!r} has an empty prompt; "
                              "a prompt needs at least one token.")

    @property
    def output_text(self) -> str | None:
        """Decoded output (cut at a matched stop string), when the engine has a tokenizer."""
        return self.detokenizer.text if self.detokenizer is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the length whose KV the next decode step needs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """The longest this request can get: prompt + max_tokens − 1 tokens of KV."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def keys_of(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """`block_keys`, holding at least the keys of its first `num_blocks` full blocks of
        `block_size` tokens (a long prompt's are cut once, not at every lookup)."""
        keys = self.block_keys
        if self.block_keys_size != block_size:
            keys.clear()
            self.block_keys_size = block_size
        for k in range(len(keys), num_blocks):
            keys.append(tuple(self.token_slice(k * block_size, (k + 1) * block_size)))
        return keys

    @property
    def num_prompt_scored(self) -> int | None:
        """With `sampling.prompt_logprobs`, prompt positions whose logits are scored yet
        (position q's logits score prompt token q + 1, so q < this is done); None when the
        request scores no prompt or has scored all of it."""
        if self.sampling.prompt_logprobs is None:
            return None
        n = len(self.prompt_logprobs_out)
        return n if n < len(self.prompt_token_ids) - 1 else None

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to compute before the next token can be sampled (1 for a decode)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True once the prompt (and any recomputation) is done and one token at a time remains."""
        out = self.output_token_ids
        return bool(out) and \
            len(self.prompt_token_ids) + len(out) - self.num_computed_tokens == 1
