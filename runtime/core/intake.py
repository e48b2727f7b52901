"""Requests on their way in: validated on the caller's thread, bounded by the waiting
queue, held until their arrival time, and cancelled if aborted before it.

`Intake.add` runs on any thread (the server's, the console's): it refuses what the engine
could never serve with one sentence (a `RequestError`, `QueueFullError` or
`EngineFailedError`), builds the request and its samples, and posts it to the engine's
inbox. The engine thread then files it by arrival time (`hold`), releases it when its time
comes (`due`), and counts it out of the queue when it ends (`count`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator

from kvdeck.runtime.core.clock import WallClock
from kvdeck.runtime.core.commands import AddRequest, InboxMessage
from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.request import Request, RequestStatus, SamplingParams
from kvdeck.runtime.errors import EngineFailedError, QueueFullError, RequestError
from kvdeck.runtime.executors.base import Executor
from kvdeck.runtime.text.checks import AnswerCheck
from kvdeck.runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer

MAX_BRANCHES = 64
"""The most samples of one prompt (`n`, `best_of`)."""


class Intake:
    """New requests between their submission and the scheduler."""

    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: Tokenizer | None,
                 clock: WallClock, max_model_len: int, post: Callable[[InboxMessage], None],
                 failure: Callable[[], str | None]):
        """`post` puts a message in the engine's inbox; `failure` is why the engine stopped
        (None while it runs)."""
        self.config, self.executor, self.tokenizer = config, executor, tokenizer
        self.clock, self.max_model_len = clock, max_model_len
        self.post, self.failure = post, failure
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.future: list[tuple[float, int, Request]] = []
        """Requests not arrived yet, a heap by arrival time (engine thread)."""
        self.cancelled: list[Request] = []
        """Requests aborted before they arrived, for their listeners (engine thread)."""
        self.num_queued = 0
        """Requests submitted and not ended, samples counted: what `max_waiting` bounds."""
        self._grammars = None
        """Compiles output constraints (`guided.Grammars`), made on the first one."""

    def add(self, prompt_token_ids: list[int], sampling: SamplingParams | None = None, *,
request_id: str | None = None, arrival_time: float | None = None,
            deadline_s: float | None = None, priority: int = 0, track: bool = False,
            check: AnswerCheck | None = None, branches: int = 1,
            intake_s: float = 0.0, remote_kv_tokens: int = 0) -> Request:
        """Validate and queue a request; returns it at once (it runs on the engine thread).

        `arrival_time` in the future (engine clock) schedules the arrival, as trace replay
        does; `intake_s` holds the request that long after its arrival before the engine
        takes it in (`Request.intake_time`); `remote_kv_tokens` of the prompt arrive
        computed from another instance (`Request.remote_kv_tokens`); `deadline_s` is
        relative to arrival; `track` puts the request's text in every snapshot (the
        console's prompt); `check` is what the answer must satisfy to count as correct (it
        needs a tokenizer: checks read text); `branches` > 1 (the API's `n`) samples the
        prompt that many times: the request returned is the first sample and `branches`
        holds the others, which share its prompt's KV blocks (one prefill). Seeded branches
        take seeds `seed`, `seed + 1`, ... (as vLLM's). Raises RequestError,
        QueueFullError or EngineFailedError.
        """
        failure = self.failure()
        if failure is not None:
            raise EngineFailedError(f"The engine has stopped ({failure}); it takes no new "
                                    "requests.")
        sampling = sampling or SamplingParams()
        n = len(prompt_token_ids)
        if sampling.stop and self.tokenizer is None:
            raise RequestError("Stop strings need a tokenizer, and this engine has none; "
                               "use stop token ids instead.")
        if check is not None and self.tokenizer is None:
            raise RequestError("Answer checks read the answer's text, which needs a "
                               "tokenizer, and this engine has none.")
        if n == 0:
            raise RequestError("The prompt is empty; a prompt needs at least one token.")
        if not 1 <= branches <= MAX_BRANCHES:
            raise RequestError(f"n must be from 1 to {MAX_BRANCHES}, got {branches}.")
        if branches > self.config.max_waiting:
            raise RequestError(f"n = {branches} samples cannot all queue: the waiting queue "
                               f"holds {self.config.max_waiting:,} requests (--max-waiting).")
        guide = self._start_guide(sampling) if sampling.guide is not None else None
        self._check_lengths(n, sampling.max_tokens, remote_kv_tokens)
        with self._lock:
            if self.num_queued + branches > self.config.max_waiting:
                raise QueueFullError(f"The waiting queue is full ({self.config.max_waiting:,} "
                                     "requests); retry later.")
            self.num_queued += branches
            rid = request_id or f"req-{next(self._ids)}"
        arrival = self.clock.arrival_time() if arrival_time is None else arrival_time

        def make(request_id: str, params: SamplingParams) -> Request:
            r = Request(request_id, list(prompt_token_ids), params, arrival_time=arrival,
                        deadline=arrival + deadline_s if deadline_s is not None else None,
                        priority=priority, check=check,
                        intake_time=arrival + intake_s if intake_s > 0 else None,
                        remote_kv_tokens=remote_kv_tokens)
            if self.tokenizer is not None:
                r.detokenizer = IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids,
                                                       params.stop)
            r.tracked = track
            return r

        req = make(rid, sampling)
        req.guide = guide
        seed = sampling.seed
        # Branches sample on their own (their seeds, or their ids), and the prompt's
        # logprobs are the first sample's to report.
        req.branches = [make(f"{rid}.{i}", dataclasses.replace(
            sampling, seed=None if seed is None else seed + i, prompt_logprobs=None))
            for i in range(1, branches)]
        req.branched = not req.branches
        self.post(AddRequest(req))
        return req

    def _check_lengths(self, n: int, max_tokens: int, remote_kv_tokens: int) -> None:
        """A prompt of `n` tokens and `max_tokens` more fit the context; RequestError
        otherwise."""
        if n > self.max_model_len - 1:
            raise RequestError(f"The prompt has {n:,} tokens but the model's context allows "
                               f"at most {self.max_model_len - 1:,}.")
        if not 0 <= remote_kv_tokens < n:
            raise RequestError(f"remote_kv_tokens must be from 0 to the prompt's length less "
                               f"one ({n - 1:,}), got {remote_kv_tokens:,}.")
        if remote_kv_tokens and self.config.free_window_kv:
            raise RequestError("remote_kv_tokens cannot go with free_window_kv: window pages "
                               "are not sent between instances.")
        if n + max_tokens > self.max_model_len:
            raise RequestError(
                f"max_tokens {max_tokens:,} with a {n:,}-token prompt exceeds the "
                f"context of {self.max_model_len:,} tokens; at most "
                f"{self.max_model_len - n:,} new tokens fit.")

    def _start_guide(self, sampling: SamplingParams):
        """A request's grammar state (`runtime/text/guided.py`), compiled on the caller's thread;
        RequestError when the constraint does not compile or this engine cannot apply it."""
        if not self.executor.info.computes_logits:
            raise RequestError("Constrained output (a JSON schema, regex, choice or grammar) "
                               "needs a model executor (torch or llama_cpp); the sim executor "
                               "computes no logits to constrain.")
        if self.tokenizer is None:
            raise RequestError("Constrained output needs the model's tokenizer, and this "
                               "engine has none.")
        with self._lock:
            if self._grammars is None:
                from kvdeck.runtime.text.guided import Grammars

                ends = (*self.executor.info.eos_token_ids, *self.tokenizer.end_of_turn_ids)
                self._grammars = Grammars(self.tokenizer, tuple(dict.fromkeys(ends)),
                                          self.executor.info.vocab_size)
        return self._grammars.start(sampling.guide)

    def count(self, n: int) -> None:
        """`n` more requests queued (a fork), or fewer (negative: they ended)."""
        with self._lock:
            self.num_queued += n

    # -- the engine thread ------------------------------------------------------------------

    def hold(self, req: Request) -> None:
        """File a submitted request by its arrival time."""
        due = req.arrival_time if req.intake_time is None else req.intake_time
        heapq.heappush(self.future, (due, next(self._ids), req))

    @property
    def next_arrival(self) -> float | None:
        return self.future[0][0] if self.future else None

    def due(self, now: float) -> Iterator[Request]:
        """The held requests whose arrival time has come, in arrival order."""
        future = self.future
        while future and future[0][0] <= now:
            yield heapq.heappop(future)[2]

    def cancel(self, rid: str, reason: str) -> bool:
        """Abort held request `rid` and its samples before they arrive; False when no such
        request is held."""
        for i, (_, _, r) in enumerate(self.future):
            if r.request_id == rid:
                self.future.pop(i)
                heapq.heapify(self.future)
                for x in (r, *r.branches):  # its other samples never started either
                    x.status, x.reason = RequestStatus.ABORTED, reason
                    x.finish_time = x.arrival_time
                    self.cancelled.append(x)
                r.branched = True
                return True
        return False

    def take_cancelled(self) -> list[Request]:
        cancelled, self.cancelled = self.cancelled, []
        return cancelled

    def drop_all(self) -> list[Request]:
        """Every held request, removed (the engine failed)."""
        held = [r for _, _, r in self.future]
        self.future.clear()
        return held
