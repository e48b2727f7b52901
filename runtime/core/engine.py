"""The engine: the three-call iteration, a thread-safe inbox, clocks and failure.

    plan   = scheduler.schedule()
    result = executor.execute(plan)
    events = scheduler.update(plan, result)

Everything from outside — new requests, aborts, knob changes, pause, resume, single steps,
starting and stopping a recording, a prefix-cache reset — is a typed message (`commands.py`)
put in `inbox` and applied at the start of an iteration, so engine state is touched only by
the thread that calls `step()`. Knob changes are validated when submitted (an invalid value
raises and changes nothing) and recorded in the iteration trace when applied.

Failure contract: an executor's `StepError` fails that step's requests and the engine goes
on; any other exception stops the engine (`fail`): every pending request is aborted with the
reason, listeners are told (so output streams end with an error), the traceback goes to a
log file, and new requests are refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable

from kvdeck.runtime.core.checkpoint import Checkpoint, RequestState, checkpoint_of
from kvdeck.runtime.core.clock import PacedClock, VirtualClock, WallClock
from kvdeck.runtime.core.commands import (
    Abort,
    AddRequest,
    InboxMessage,
    Pause,
    ResetPrefixCache,
    Resume,
    SetKnobs,
    SetPriority,
    StartRecording,
    StepOnce,
    StopRecording,
    Watch,
)
from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.failure import EngineFailure, abort_all
from kvdeck.runtime.core.intake import Intake
from kvdeck.runtime.core.pool_size import set_up
from kvdeck.runtime.core.request import Request, RequestStatus, SamplingParams
from kvdeck.runtime.core.scheduler import Scheduler
from kvdeck.runtime.core.step_data import (
    SchedulerOutput,
    StepResult,
    StepTiming,
)
from kvdeck.runtime.core.step_record import Finished, Forked, StepRecord
from kvdeck.runtime.core.switches import KnobSwitches
from kvdeck.runtime.errors import StepError
from kvdeck.runtime.executors.base import Drafting, Executor, LaunchHold, has
from kvdeck.runtime.kv.transfers import TransferLog
from kvdeck.runtime.logs import write_failure
from kvdeck.runtime.stats.figures import RunFigures, step_figures
from kvdeck.runtime.stats.metrics import request_metrics
from kvdeck.runtime.text.tokenizer import Tokenizer

log = logging.getLogger("kvdeck.engine")
MAX_TRACKED = 8


class Engine:
    """Scheduler + KV manager + executor, stepped by one thread."""

    def __init__(self, config: EngineConfig, executor: Executor, *,
                 tokenizer: Tokenizer | None = None, pace: float | None = None,
                 completed_history: int = 10_000):
        """`pace`: for a virtual-time executor, virtual seconds per wall second (the console
        and the simulated server); None runs virtual time as fast as it goes."""
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        """Detokenizes outputs and matches stop strings (None: token ids only)."""
        config, self.pool = set_up(config, executor)
        self.config, self.groups = config, self.pool.groups
        """`groups`: the layer groups when sliding-window KV is freed (`kv/groups.py`)."""
        self.max_model_len = min(config.max_model_len or executor.info.max_model_len,
                                 executor.info.max_model_len)
        self.clock: WallClock = (PacedClock(pace) if pace else VirtualClock()) \
            if executor.info.virtual_time else WallClock()
        self.step_count = 0
        self.num_changes = 0
        """Bumped by every inbox message and every step: a loop publishes a snapshot when
        it moved."""
        k = config.knobs
        self.kv = self.pool.manager(lambda: self.step_count)
        self.transfer_log = TransferLog()
        self.scheduler = Scheduler(config, self.kv, executor.estimate_step_seconds,
                                   self.max_model_len, executor.info.eos_token_ids)
        self.scheduler.propose = lambda req, k: executor.propose(req, k, self.scheduler.knobs)
        self.scheduler.slots = getattr(executor, "slots", None)  # the sim's `--server-slots`
        self._holds = has(executor, LaunchHold) and executor.holds
        if isinstance(executor, Drafting):
            self.scheduler.drafts.draft_estimate = executor.estimate_draft_seconds
        self.stop_event = threading.Event()  # cuts a paced step's sleep short (shutdown)
        self.switcher = KnobSwitches(executor, self.kv, self.scheduler, self.clock, self.pool,
                                     self.stop_event, k.kv_format)
        self.switcher.check(k)
        self.inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self.wake = threading.Event()
        """Set whenever something is put in the inbox, so an idle loop wakes up."""
        self.submitted_knobs = k
        """The knobs that will apply (validated on submission; applied between steps)."""
        self._lock = threading.Lock()
        self.intake = Intake(config, executor, tokenizer, self.clock, self.max_model_len,
                             self.post, lambda: self.failure and self.failure.message)
        self.add_request = self.intake.add
        """Validate and queue a request (any thread): `Intake.add`."""
        self._forks: list[Forked] = []
        self.figures = RunFigures()
        self.completed: deque[Request] = deque(maxlen=completed_history)
        """The most recently finished requests (bounded: a server runs for days)."""
        self.on_finish: list[Callable[[Request], None]] = []
        """Called on the engine thread with each request that reaches a final state."""
        self.after_step: list[Callable[[Engine], None]] = []
        """Called on the engine thread after every iteration that did something."""
        self.recorder: Callable[..., None] | None = None  # gets each StepRecord (runs/)
        self._recorder_actions: list[object | None] = []
        """Recorders to attach (a Recorder) or a detach (None), in the order asked."""
        self.last_step: tuple[StepRecord, int, int] | None = None
        """The last step that ran, with its token budget and sequence limit (the
        snapshot's batch view)."""
        self.last_record: StepRecord | None = None  # the last one finished, ran or idle
        self.state_end: float | None = None
        """End time of the step that produced the current state; None once the engine has
        idled since (snapshots then show the clock's time). Live and replayed snapshots of
        the same step thus carry the same time."""
        self.paused = False
        self._step_credit = 0
        self.failure: EngineFailure | None = None
        self.tracked: dict[str, Request] = {}
        self.watched: Request | None = None
        self.watched_id: str | None = None

    # -- thread-safe submission -------------------------------------------------------------

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        """Abort a request; returns at once. Its blocks come back after the in-flight step."""
        self.post(Abort(request_id, reason))

    def set_knobs(self, **changes) -> Knobs:
        """Validate knob changes now (raising ConfigError, changing nothing, if invalid) and
        apply them at the next iteration boundary. Returns the knobs that will apply."""
        with self._lock:
            new = self.submitted_knobs = self.switcher.submit(self.submitted_knobs, changes)
        self.post(SetKnobs(new, changes))
        return new

    def fork(self, parent: Request, child_id: str,
             sampling: SamplingParams | None = None) -> Request:
        """Branch a running request (engine thread only): the child shares every block of
        the parent and continues from the same tokens; the next record says so."""
        child = self.scheduler.fork(parent, child_id, sampling)
        self.intake.count(1)
        self._forks.append(Forked(child_id, parent.request_id, child.sampling.max_tokens))
        return child

    def post(self, message: InboxMessage) -> None:
        """Put a message in the inbox (any thread) and wake the engine."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("inbox %s", message.to_json())
        self.inbox.put(message)
        self.wake.set()

    # -- the iteration ----------------------------------------------------------------------

    def _drain_inbox(self, record: StepRecord) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.num_changes += 1
            if isinstance(msg, AddRequest):
                req = msg.request
                self.intake.hold(req)
                if self.watched is None and req.request_id == self.watched_id:
                    self.watched = req  # watched before it arrived
                if req.tracked:
                    self.tracked[req.request_id] = req
                    while len(self.tracked) > MAX_TRACKED:
                        del self.tracked[next(iter(self.tracked))]
            elif isinstance(msg, Abort):
                self._abort(msg.request_id, msg.reason)
            elif isinstance(msg, SetKnobs):
                record.switches += self.switcher.apply(msg.knobs, self.step_count)
                self.scheduler.apply_knobs(msg.knobs)
                record.knobs.update(msg.changes)
            elif isinstance(msg, Pause):
                self.paused = True
                self.clock.freeze()
            elif isinstance(msg, Resume) and self.paused:  # (a resume unpaused is a no-op)
                self.paused = False
                self.clock.resume()
            elif isinstance(msg, StepOnce):
                self._step_credit += msg.count
            elif isinstance(msg, Watch):
                self.watched = self.find(msg.request_id) if msg.request_id else None
                self.watched_id = msg.request_id
            elif isinstance(msg, SetPriority):
                req = self.find(msg.request_id)
                if req is not None and not req.status.is_finished:
                    req.events.append((self.clock.now(), f"priority {req.priority} → "
                                                         f"{msg.priority}"))
                    req.priority = msg.priority
            elif isinstance(msg, StartRecording | StopRecording):
                self._recorder_actions.append(getattr(msg, "recorder", None))
            elif isinstance(msg, ResetPrefixCache):
                self.kv.clear_cache()

    def _abort(self, rid: str, reason: str) -> None:
        req = self.scheduler.abort(rid, self.clock.now(), reason)
        if req is None:  # not yet arrived: drop it from the future arrivals
            self.intake.cancel(rid, reason)

    def _release_arrivals(self, record: StepRecord) -> float:
        """Move requests whose arrival time has come into the scheduler, through the hold
        of an executor that holds its loop before taking them in; returns now."""
        clock = self.clock
        # Idle on virtual time: jump to the next arrival (a paced clock jumps only for a
        # single step asked for while paused).
        jumps = clock.jumps or (self.paused and self.executor.info.virtual_time)
        due = self.intake.next_arrival
        if jumps and not self.scheduler.running and not self.scheduler.waiting and due:
            clock.advance_to(due)
        now = clock.now()
        for req in self.intake.due(now):
            # Time spent between the scheduled arrival and this step counts as resident.
            self.figures.on_arrival(now - req.arrival_time)
            req.events.append((req.arrival_time, "arrived"))
            self.scheduler.add(req)
            if self.recorder is not None:
                on_request = getattr(self.recorder, "on_request", None)
                if on_request is not None:
                    on_request(req)
            record.arrived.append(RequestState.arriving(req))
        if self._holds and (hold := self.executor.launch_hold(self.scheduler.waiting)) > 0:
            clock.advance(hold)  # and those that arrive meanwhile come in too (`LaunchHold`)
            return self._release_arrivals(record)
        return now

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self.intake.future
                    or not self.inbox.empty())

    def next_arrival_in(self) -> float | None:
        """Wall seconds until the next scheduled arrival, or None when none is scheduled."""
        due = self.intake.next_arrival
        return None if due is None else self.clock.seconds_until(due)

    def step(self) -> StepRecord | None:
        """Run one iteration; returns its record, or None when nothing happened."""
        record = StepRecord(self.step_count, t0=self.clock.now())
        record.forked, self._forks = self._forks, []
        self._drain_inbox(record)
        if self.paused:
            if not self._step_credit:
                return self._idle(record)
            self._step_credit -= 1
        self.clock.pin()
        record.t0 = t0 = self._release_arrivals(record)
        plan = self.scheduler.schedule(self.step_count, t0)
        if plan.is_empty:
            self.clock.float()  # nothing ran: a paced clock follows the wall until work comes
            return self._idle(record, plan)
        self.num_changes += 1
        self.kv.begin_step()
        try:
            result = self.executor.execute(plan)
        except StepError as e:  # failure contract: fail the step's requests, keep serving
            log.warning("step %d failed: %s", self.step_count, e)
            result = StepResult({}, StepTiming(0.0, True, 0, 0, 0),
                                {c.request_id: str(e) for c in plan.chunks})
            if plan.transfers:  # copies out may not have happened: trust no host copy
                self.scheduler.unswap_all(self.clock.now(), "the step that copied it failed")
                self.kv.tree.drop_host()
        finally:
            self.kv.end_step()
        resident = self.scheduler.num_waiting + self.scheduler.num_running
        dt = result.timing.seconds
        self.clock.advance(dt)
        self.clock.wait_until_due(self.stop_event)  # a paced sim step takes its time
        t1 = self.state_end = self.clock.now()
        self.scheduler.update(plan, result, t1)
        if result.lost_blocks:
            self.kv.tree.forget_blocks(result.lost_blocks)
        for child, parent in self.scheduler.take_branched():
            record.forked.append(Forked(child.request_id, parent.request_id,
                                        child.sampling.max_tokens, True))
        record.ran(plan, result, t1)
        self.last_step = (record, plan.token_budget, plan.max_num_seqs)
        if result.draft_seconds:
            self.scheduler.spec.on_draft_step(result.draft_seconds, dt)
        if result.transfers:
            self.transfer_log.on_step(plan.step, result.transfers)
        self._collect(record)
        self.step_count += 1
        record.resident = resident
        self._finish_step(record)
        return record

    def _idle(self, record: StepRecord, plan: SchedulerOutput | None = None) -> \
            StepRecord | None:
        """End a step that ran nothing: still a record if knobs, arrivals, rejections or
        aborts happened."""
        self.state_end = None
        self._collect(record)
        if plan is not None:  # a plan may preempt and still schedule nothing
            record.rejected = list(plan.rejected)
            record.preempted, record.swapped = list(plan.preempted), list(plan.swapped)
        record.kv = self.kv.take_events()
        if record.is_empty:
            self._switch_recorder()
            return None
        self._finish_step(record)
        return record

    def _finish_step(self, record: StepRecord) -> None:
        """Complete the record, update the figures, write the record, tell `after_step`
        listeners (output streams), then attach or detach a recorder if asked."""
        record.kv += self.kv.take_events()
        self.last_record = record
        sched = self.scheduler
        record.queue = (sched.num_waiting, sched.num_running)
        record.dropped = sched.take_dropped()
        if record.dt is not None:
            kv = self.kv
            self.figures.on_step(step_figures(record, kv.usage,
                                              kv.tree.num_evictable / kv.num_blocks,
                                              kv.tree.hit_rate), record)
        else:
            self.figures.waste.on_idle(record)
        if self.recorder is not None:
            self.recorder(record)
        for callback in self.after_step:
            callback(self)
        self._switch_recorder()

    def _switch_recorder(self) -> None:
        """Between steps: detach and close the current recorder, attach new ones (each
        starting with a checkpoint of the state now), in the order they were asked for."""
        actions, self._recorder_actions = self._recorder_actions, []
        for rec in actions:
            old, self.recorder = self.recorder, None
            if old is not None and hasattr(old, "close"):
                old.close()
            if rec is not None:
                rec.begin(self.checkpoint())
                self.recorder = rec

    def _collect(self, record: StepRecord) -> None:
        """Hand finished requests to their listeners. Requests cancelled before they arrived
        never entered the engine: their clients are told, the figures and trace are not."""
        done = self.scheduler.take_finished()
        cancelled = self.intake.take_cancelled() + self.scheduler.take_unstarted()
        if not done and not cancelled:
            return
        self.intake.count(-len(done) - len(cancelled))
        for req in done:
            self.completed.append(req)
            if req.check is not None and req.status in (RequestStatus.FINISHED_STOPPED,
                                                        RequestStatus.FINISHED_LENGTH):
                req.correct = req.check.passes(req.output_text or "")
            self.figures.on_finish(request_metrics(req))
            self.executor.forget(req.request_id)
            record.finished.append(Finished(req.request_id, req.status.value, req.reason,
                                            req.finish_time, req.correct))
        for req in done + cancelled:
            for callback in self.on_finish:
                callback(req)

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step until nothing is queued, running or due to arrive; returns steps taken."""
        n = 0
        while self.has_work and (max_steps is None or n < max_steps):
            if self.step() is None and not self.intake.future and self.inbox.empty():
                break
            n += 1
        return n

    # -- failure ----------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> EngineFailure:
        """Stop for good after an unexpected exception: write the traceback to a log file,
        abort every pending request with the reason (their streams end with an error) and
        refuse new ones. Returns the failure the snapshot reports."""
        message = f"{type(exc).__name__}: {exc}".strip()
        path = write_failure(exc, f"engine failed at step {self.step_count}: {message}")
        self.failure = EngineFailure(message, str(path) if path else None)
        now = self.clock.now()
        abort_all(self.scheduler, self.intake, self.inbox, self.kv, f"engine failed: {message}",
                  now)
        record = StepRecord(self.step_count, t0=now)
        self._collect(record)
        for callback in self.after_step:
            callback(self)
        return self.failure

    # -- views ------------------------------------------------------------------------------

    def find(self, request_id: str) -> Request | None:
        """The request with this id, wherever it is: queued, running, due or finished."""
        sched = self.scheduler
        for req in itertools.chain(sched.running, sched.waiting,
                                   (r for _, _, r in self.intake.future),
                                   reversed(self.completed)):
            if req.request_id == request_id:
                return req
        return None

    def checkpoint(self) -> Checkpoint:
        """The state a recording starting now begins from (engine thread, between steps)."""
        sched, kv = self.scheduler, self.kv
        return checkpoint_of(
            kv.state, step=self.step_count, time=self.clock.now(),
            knobs=dataclasses.asdict(sched.knobs),
            requests=[RequestState.of(r) for r in (*sched.running, *sched.waiting)],
            counters={"preemptions": sched.num_preemptions, "cow": kv.num_cow_copies,
                      "swapped": sched.num_swapped},
            figures=self.figures.to_json(), switches=list(self.switcher.recent),
            transfer_log=self.transfer_log, spec=sched.spec.to_json())

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for req in self.scheduler.running:
            assert req.request_id in self.kv.tables
            if req.sampling.prompt_logprobs is not None:
                # Every computed prompt position scored its next token, once.
                scored = len(req.prompt_logprobs_out)
                want = min(req.num_computed_tokens, req.num_prompt_tokens - 1)
                assert want <= scored <= req.num_prompt_tokens - 1, \
                    f"{req.request_id} scored {scored} prompt tokens, computed {want}"
        for req in self.scheduler.waiting:
            assert req.request_id not in self.kv.tables
            assert (req.status is RequestStatus.SWAPPED) == \
                (req.request_id in self.kv.host_tables), f"{req.request_id} swap state"

    def close(self) -> None:
        self.stop_event.set()
        self.executor.close()
