"""The engine: the three-call iteration, a thread-safe inbox, clocks and snapshots.

    plan   = scheduler.schedule()
    result = executor.execute(plan)
    events = scheduler.update(plan, result)

Everything from outside — new requests, aborts, knob changes — goes through `inbox` and is
applied at the start of an iteration, so engine state is touched only by the thread that
calls `step()`. Knob changes are validated when submitted (an invalid value raises and
changes nothing) and recorded in the iteration trace when applied.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from runtime.config import EngineConfig, Knobs
from runtime.errors import QueueFullError, RequestError
from runtime.executors.base import Executor
from runtime.kv.manager import BlockManager
from runtime.metrics import Distribution, RunStats, request_metrics
from runtime.plan import SchedulerOutput, StepResult, StepTiming, causal_pairs
from runtime.request import Request, RequestStatus, SamplingParams
from runtime.scheduler import Scheduler
from runtime.snapshot import BatchView, EngineSnapshot, KVView, RequestView
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer


class VirtualClock:
    """Modelled time: advances only by step durations and jumps to the next arrival."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


class WallClock:
    """Measured time in seconds since the engine started."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def advance(self, seconds: float) -> None:
        """Wall time advances by itself."""

    def advance_to(self, t: float) -> None:
        """Wall time cannot jump; the loop waits instead."""


class Engine:
    """Scheduler + KV manager + executor, stepped by one thread."""

    def __init__(self, config: EngineConfig, executor: Executor,
                 completed_history: int = 10_000, tokenizer: Tokenizer | None = None):
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        """Detokenizes outputs and matches stop strings; None for the sim executor."""
        self.kv_bytes_per_token = executor.kv_bytes_per_token(config.kv_format)
        num_blocks = config.blocks_for_budget(self.kv_bytes_per_token)
        executor.bind_kv(num_blocks, config.block_size, config.kv_format)
        self.max_model_len = min(config.max_model_len or executor.max_model_len,
                                 executor.max_model_len)
        self.clock = VirtualClock() if executor.virtual_time else WallClock()
        k = config.knobs
        self.kv = BlockManager(
            num_blocks, config.block_size, enable_caching=k.enable_prefix_caching,
            cache_capacity=k.prefix_cache_capacity, eviction_policy=k.eviction_policy,
            namespace=f"{executor.model_name}|{config.kv_format}|{config.namespace}",
            bytes_per_block=self.kv_bytes_per_token * config.block_size,
            recompute_cost=lambda h, c: executor.estimate_step_seconds(
                c, causal_pairs(c, h), h + c),
            clock=self.clock.now,
        )
        self.scheduler = Scheduler(config, self.kv, executor.estimate_step_seconds,
                                   self.max_model_len, executor.eos_token_ids)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        """Set whenever something is put in the inbox, so an idle loop wakes up."""
        self._submitted_knobs = k
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._future: list[tuple[float, int, Request]] = []
        self._num_queued = 0
        self.step_count = 0
        self.stats = RunStats()
        self.completed: deque[Request] = deque(maxlen=completed_history)
        """The most recently finished requests (bounded: a server runs for days)."""
        self.on_finish: list[Callable[[Request], None]] = []
        self.after_step: list[Callable[[Engine], None]] = []
        """Called on the engine thread after every iteration that did something."""
        """Called on the engine thread with each request that reaches a final state."""
        self.recent: deque = deque(maxlen=256)
        self.recorder: Callable[[dict], None] | None = None
        """Receives one iteration record per step (see runtime/recording.py)."""
        self.last_batch: BatchView | None = None
        self.num_by_status: dict[RequestStatus, int] = dict.fromkeys(RequestStatus, 0)

    # -- thread-safe submission -------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams | None = None,
                    *, request_id: str | None = None, arrival_time: float | None = None,
                    deadline_s: float | None = None, priority: int = 0) -> Request:
        """Validate and queue a request; returns it at once (it runs on the engine thread).

        `arrival_time` in the future (engine clock) schedules the arrival, as trace replay
        does; `deadline_s` is relative to arrival. Raises RequestError or QueueFullError.
        """
        sampling = sampling or SamplingParams()
        n = len(prompt_token_ids)
        if sampling.stop and self.tokenizer is None:
            raise RequestError("Stop strings need a tokenizer, and this engine has none; "
                               "use stop token ids instead.")
        if n == 0:
            raise RequestError("The prompt is empty; a prompt needs at least one token.")
        if n > self.max_model_len - 1:
            raise RequestError(f"The prompt has {n:,} tokens but the model's context allows "
                               f"at most {self.max_model_len - 1:,}.")
        if n + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"max_tokens {sampling.max_tokens:,} with a {n:,}-token prompt exceeds the "
                f"context of {self.max_model_len:,} tokens; at most "
                f"{self.max_model_len - n:,} new tokens fit.")
        with self._lock:
            if self._num_queued >= self.config.max_waiting:
                raise QueueFullError(f"The waiting queue is full ({self.config.max_waiting:,} "
                                     "requests); retry later.")
            self._num_queued += 1
            rid = request_id or f"req-{next(self._ids)}"
        arrival = self.clock.now() if arrival_time is None else arrival_time
        req = Request(rid, list(prompt_token_ids), sampling, arrival_time=arrival,
                      deadline=arrival + deadline_s if deadline_s is not None else None,
                      priority=priority)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                     sampling.stop)
        self._post(("add", req))
        return req

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        """Abort a request; returns at once. Its blocks come back after the in-flight step."""
        self._post(("abort", request_id, reason))

    def set_knobs(self, **changes) -> Knobs:
        """Validate knob changes now (raising ConfigError, changing nothing, if invalid) and
        apply them at the next iteration boundary. Returns the knobs that will apply."""
        with self._lock:
            new = self._submitted_knobs.with_changes(**changes)
            self._submitted_knobs = new
        self._post(("knobs", new, changes))
        return new

    def _post(self, item: tuple) -> None:
        self.inbox.put(item)
        self.wake.set()

    # -- the iteration ----------------------------------------------------------------------

    def _drain_inbox(self, record: dict) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "add":
                req = item[1]
                heapq.heappush(self._future, (req.arrival_time, next(self._ids), req))
            elif kind == "abort":
                self._abort(item[1], item[2])
            elif kind == "knobs":
                self.scheduler.apply_knobs(item[1])
                record.setdefault("knobs", {}).update(item[2])

    def _abort(self, rid: str, reason: str) -> None:
        req = self.scheduler.abort(rid, self.clock.now(), reason)
        if req is None:  # not yet arrived: drop it from the future arrivals
            for i, (_, _, r) in enumerate(self._future):
                if r.request_id == rid:
                    self._future.pop(i)
                    heapq.heapify(self._future)
                    r.status, r.reason = RequestStatus.ABORTED, reason
                    r.finish_time = r.arrival_time
                    self.scheduler.finished.append(r)
                    break

    def _release_arrivals(self, record: dict) -> None:
        now = self.clock.now()
        if not self.scheduler.running and not self.scheduler.waiting and self._future:
            self.clock.advance_to(self._future[0][0])  # idle: jump (virtual) or no-op (wall)
            now = self.clock.now()
        arrived = record.setdefault("arrived", [])
        while self._future and self._future[0][0] <= now:
            _, _, req = heapq.heappop(self._future)
            # Time spent between the scheduled arrival and this step counts as resident.
            self.stats.on_interval(1, now - req.arrival_time)
            self.scheduler.add(req)
            on_request = getattr(self.recorder, "on_request", None)
            if on_request is not None:
                on_request(req)
            arrived.append([req.request_id, req.arrival_time, req.num_prompt_tokens,
                            req.sampling.max_tokens, req.deadline, req.priority])
        if not arrived:
            del record["arrived"]

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._future
                    or not self.inbox.empty())

    def step(self) -> dict | None:
        """Run one iteration; returns its trace record, or None when there was nothing to do."""
        record: dict = {"step": self.step_count}
        self._drain_inbox(record)
        self._release_arrivals(record)
        t0 = self.clock.now()
        plan = self.scheduler.schedule(self.step_count, t0)
        if plan.is_empty:
            self._collect(record)
            if len(record) > 1:  # knobs, arrivals or rejections happened: still a record
                self._finish_step(record, plan, None, t0)
                return record
            return None
        self.kv.begin_step()
        try:
            result = self.executor.execute(plan)
        except Exception as e:  # noqa: BLE001 - failure contract: fail the step's requests
            result = StepResult({}, StepTiming(0.0, True, 0, 0, 0),
                                {c.request_id: f"{type(e).__name__}: {e}" for c in plan.chunks})
        finally:
            self.kv.end_step()
        resident = self.scheduler.num_waiting + self.scheduler.num_running
        self.clock.advance(result.timing.seconds)
        t1 = self.clock.now()
        self.stats.on_interval(resident, t1 - t0)
        self.scheduler.update(plan, result, t1)
        self.stats.on_step(len(plan.chunks), plan.num_batched_tokens, plan.num_prefill_tokens,
                           plan.num_decode_tokens, result.timing.seconds)
        self.last_batch = BatchView(plan.step, plan.num_decode_tokens, plan.num_prefill_tokens,
                                    len(plan.chunks), plan.token_budget, plan.max_num_seqs,
                                    result.timing.seconds, len(plan.preempted))
        self._collect(record)
        self.step_count += 1
        self._finish_step(record, plan, result, t0)
        return record

    def _finish_step(self, record: dict, plan: SchedulerOutput, result: StepResult | None,
                     t0: float) -> None:
        """Write the iteration record, then tell `after_step` listeners (output streams)."""
        self._emit(record, plan, result, t0)
        for callback in self.after_step:
            callback(self)

    def _collect(self, record: dict) -> None:
        done = self.scheduler.take_finished()
        if not done:
            return
        with self._lock:
            self._num_queued -= len(done)
        for req in done:
            self.completed.append(req)
            self.num_by_status[req.status] += 1
            self.recent.append(request_metrics(req))
            forget = getattr(self.executor, "forget", None)
            if forget is not None:
                forget(req.request_id)
            for callback in self.on_finish:
                callback(req)
        record["finished"] = [[r.request_id, r.status.value, r.reason] for r in done]

    def _emit(self, record: dict, plan: SchedulerOutput, result: StepResult | None,
              t0: float) -> None:
        events = self.kv.take_events()
        if self.recorder is None:
            return
        record["t0"] = t0
        if result is not None:
            tm = result.timing
            record.update({
                "dt": tm.seconds, "measured": tm.measured, "bytes": tm.bytes_read,
                "plan": [[c.request_id, c.start, c.num_new_tokens, int(c.sample)]
                         for c in plan.chunks],
                "tokens": [[rid, tok] for rid, tok in result.sampled.items()],
            })
            if result.errors:
                record["errors"] = result.errors
        for key in ("admitted", "preempted", "rejected"):
            values = getattr(plan, key)
            if values:
                record[key] = list(values)
        if plan.cow_copies:
            record["cow"] = [list(p) for p in plan.cow_copies]
        if events:
            record["kv"] = [list(e) for e in events]
        record["queue"] = [self.scheduler.num_waiting, self.scheduler.num_running]
        self.recorder(record)

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step until nothing is queued, running or due to arrive; returns steps taken."""
        n = 0
        while self.has_work and (max_steps is None or n < max_steps):
            if self.step() is None and not self._future and self.inbox.empty():
                break
            n += 1
        return n

    # -- views ------------------------------------------------------------------------------

    def rolling_metrics(self) -> dict:
        """Latency distributions over the most recently finished requests, the fraction of
        them that were good (finished, and within their deadline when they had one), and
        the Little's-law check over the whole run: measured mean resident requests vs
        completion rate × mean residence."""
        recent = list(self.recent)
        done = [m for m in recent if m.status.startswith("finished")]
        good = [m for m in done if m.met_deadline is not False]
        now = max(self.clock.now(), 1e-9)
        residence = [m.finish - m.arrival for m in recent if m.finish is not None]
        finished = sum(self.num_by_status.values())
        return {
            "ttft": Distribution.of(m.ttft for m in recent if m.ttft is not None),
            "tpot": Distribution.of(m.tpot for m in recent if m.tpot is not None),
            "itl": Distribution.of(x for m in recent for x in m.itls),
            "e2e": Distribution.of(m.e2e for m in recent if m.e2e is not None),
            "good_fraction": len(good) / len(done) if done else None,
            "mean_resident": self.stats.resident_seconds / now,
            "littles_prediction": finished / now * (sum(residence) / len(residence))
            if residence else None,
        }

    def snapshot(self, max_prefix_nodes: int = 256) -> EngineSnapshot:
        """Build an immutable view; call from the engine thread (or when it is stopped)."""
        tables = self.kv.tables
        counts = self.num_by_status
        return EngineSnapshot(
            step=self.step_count, time=self.clock.now(),
            model_name=self.executor.model_name, executor=self.executor.name,
            knobs=self.scheduler.knobs,
            waiting=tuple(RequestView.of(r, None) for r in self.scheduler.waiting),
            running=tuple(RequestView.of(r, tables.get(r.request_id))
                          for r in self.scheduler.running),
            batch=self.last_batch, kv=KVView.of(self.kv, self.config.kv_format),
            prefix_nodes=tuple(self.kv.tree.summary(max_prefix_nodes)),
            num_finished=counts[RequestStatus.FINISHED_STOPPED]
            + counts[RequestStatus.FINISHED_LENGTH],
            num_rejected=counts[RequestStatus.REJECTED],
            num_aborted=counts[RequestStatus.ABORTED],
            num_preemptions=self.scheduler.num_preemptions,
            recent=self.rolling_metrics(),
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for req in self.scheduler.running:
            assert req.request_id in self.kv.tables
        for req in self.scheduler.waiting:
            assert req.request_id not in self.kv.tables

    def close(self) -> None:
        self.executor.close()
