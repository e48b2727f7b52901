"""One iteration's plan: who runs, how many tokens each, who waits, who is preempted.

Continuous batching under two budgets, tokens per iteration and sequences per iteration:

1. running requests in the decode phase get one token each, first;
2. running requests still prefilling (a chunked prompt, or recomputation after preemption)
   get chunks of at most `chunk_size` tokens from what budget is left, each ending at
   the next of `prompt_cuts` where those are set (`policies/prompt_cuts.py`);
3. waiting requests are admitted in queue-policy order while both budgets, the KV pool and
   (with admission control) their deadlines allow. Admission stops at the first request that
   does not fit, so a large request is not starved by smaller ones behind it.

With an inter-token-latency target (`itl_target_ms`), prefill chunks in steps 2 and 3 are
also capped so the step's predicted time stays within it (`step_budget.py`).

In `static` mode a group is admitted only when nothing runs, and runs until every member
has finished.

Who is preempted and how (`policies/preemption.py`), the queue order
(`policies/queue_order.py`), what admission refuses (`policies/admission.py`) and the
adaptive draft length (`policies/draft_length.py`) are policies of their own. Carrying out
a preemption is `preempt.py`; when a request stops after a token, `stop_rules.py`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvdeck.runtime.core import preempt
from kvdeck.runtime.core.config import EngineConfig, Knobs, parse_cuts
from kvdeck.runtime.core.policies.admission import DeadlineAdmission, lora_slot_limit, never_fits
from kvdeck.runtime.core.policies.draft_length import DraftLengths
from kvdeck.runtime.core.policies.preemption import preemption_mode
from kvdeck.runtime.core.policies.prompt_cuts import cut_chunk
from kvdeck.runtime.core.policies.queue_order import queue_order
from kvdeck.runtime.core.request import Request, RequestStatus
from kvdeck.runtime.core.step_budget import StepBudget, StepTotals
from kvdeck.runtime.core.step_data import Estimator, ScheduledChunk, SchedulerOutput, StepResult
from kvdeck.runtime.core.stop_rules import finish_reason, stop_after
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.spec.stats import SpecStats

if TYPE_CHECKING:
    from kvdeck.runtime.executors.server_slots import ServerSlots

Proposer = Callable[[Request, int], list[int]]
"""(request, most tokens) -> draft tokens to follow its last token (speculative decoding)."""


class Scheduler:
    """Owns the waiting queue and the running batch; plans and applies iterations."""

    def __init__(self, config: EngineConfig, kv: BlockManager, estimate: Estimator,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = ()):
        self.config = config
        self.knobs = config.knobs
        self.kv = kv
        self.estimate = estimate
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        """Requests that reached a final state since the engine last collected them."""
        self.branched: list[tuple[Request, Request]] = []
        """(branch, its first sample) started since the engine last took them (it records
        them)."""
        self.unstarted: list[Request] = []
        """Samples that ended with their request before they started (the engine tells
        their listeners; they never ran, so no record or figure counts them)."""
        self.num_preemptions = 0
        self.num_swapped = 0
        """Preemptions that swapped the victim's KV out (the rest recomputed)."""
        self.dropped: dict[str, int] = {}
        """Requests whose KV went for good since the engine last took them (preempted to
        recompute, or their host copy dropped), and the positions each had computed."""
        self.propose: Proposer | None = None
        """Drafts for speculative decoding (set by the engine from its executor)."""
        self.spec = SpecStats()
        self.drafts = DraftLengths(estimate, self.spec)
        """The adaptive draft-length rule and what it learns from."""
        self.deadlines = DeadlineAdmission(estimate, kv.block_size)
        self._prefilling: list[Request] = []
        """Running requests with prompt tokens left to compute, as of this step's plan."""
        self._target: StepBudget | None = None
        """While planning under an ITL target, the step's predicted time so far."""
        self._cuts = parse_cuts(config.prompt_cuts)
        self.slots: ServerSlots | None = None
        """The sim's llama-server slots (set by the engine): a request admitted takes a
        slot, whose kept prompt tokens count as computed for it, and prompts fill the
        step's budget in slot order, as llama-server's loop over its slots does."""

    # -- knobs ------------------------------------------------------------------------------

    def apply_knobs(self, knobs: Knobs) -> None:
        """Take new knob values (already validated) at an iteration boundary."""
        self.knobs = knobs
        self.kv.configure_cache(knobs.enable_prefix_caching, knobs.prefix_cache_capacity,
                                knobs.eviction_policy, knobs.demote_prefixes,
                                knobs.cache_admission_k, knobs.cache_admission_window)

    # -- intake -----------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a validated request (see `Engine.add_request` for validation)."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def abort(self, request_id: str, now: float,
              reason: str = "aborted by client") -> Request | None:
        """Stop planning a request; its blocks are released (after any in-flight step)."""
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._finish(req, RequestStatus.ABORTED, reason, now)
                    return req
        return None

    def fork(self, parent: Request, child_id: str, sampling=None) -> Request:
        """Branch a running request: the child shares every block of the parent (its first
        write into the shared partial tail copies it) and continues from the same tokens."""
        assert parent.status is RequestStatus.RUNNING, "only running requests can fork"
        child = Request(child_id, list(parent.prompt_token_ids), sampling or parent.sampling,
                        arrival_time=parent.arrival_time, deadline=parent.deadline,
                        priority=parent.priority, status=RequestStatus.RUNNING,
                        output_token_ids=list(parent.output_token_ids),
                        prompt_logprobs_out=list(parent.prompt_logprobs_out),
                        admitted_time=parent.admitted_time,
                        first_token_time=parent.first_token_time,
                        token_times=list(parent.token_times))
        if parent.guide is not None:
            child.guide = parent.guide.fork()
        self.kv.fork(parent, child)
        self.running.append(child)
        return child

    def _start_branches(self, parent: Request, branches: list[Request], result: StepResult,
                        now: float) -> None:
        """Start the other samples of `parent`'s prompt, which this step computed: each
        shares every block of the prompt by reference count — its first write copies the
        shared partial tail (copy-on-write) — and takes the first token the executor drew
        for it from the prompt's last logits row. Runs before the parent takes its own
        first token, so a grammar state forks from the prompt's end."""
        parent.branched = True
        # The prompt's full blocks enter the prefix cache first, so the branches' chains
        # start from the parent's nodes (caching later would meet them as strangers).
        self.kv.cache_computed(parent)
        for child in branches:
            child.status = RequestStatus.RUNNING
            child.admitted_time = parent.admitted_time
            child.events.append((now, f"branched from {parent.request_id}"))
            if parent.guide is not None:
                child.guide = parent.guide.fork()
            self.kv.fork(parent, child)
            self.running.append(child)
            self.branched.append((child, parent))
            status = self._take_token(child, result, now)
            if status is not None:
                self.running.remove(child)
                self._finish(child, status, finish_reason(child, status), now)

    def reject(self, req: Request, reason: str, now: float) -> None:
        self._finish(req, RequestStatus.REJECTED, reason, now)

    def _finish(self, req: Request, status: RequestStatus, reason: str | None,
                now: float) -> None:
        if req.branches and not req.branched:  # ended before its prompt was computed
            req.branched = True
            for child in req.branches:  # its samples never started: no record, no figures
                child.status, child.reason, child.finish_time = status, reason, now
                child.events.append((now, f"{status.value}: {reason} (with "
                                          f"{req.request_id})"))
                self.unstarted.append(child)
        req.status = status
        req.reason = reason
        req.finish_time = now
        req.events.append((now, f"{status.value}: {reason}" if reason and reason !=
                           status.value else status.value))
        if req.request_id in self.kv.tables or req.request_id in self.kv.host_tables:
            self.kv.release(req)
        self.drafts.forget(req.request_id)
        self.finished.append(req)

    # -- planning ---------------------------------------------------------------------------

    def schedule(self, step: int, now: float) -> SchedulerOutput:
        k = self.knobs
        plan = SchedulerOutput(step=step, time=now, token_budget=k.max_num_batched_tokens,
                               max_num_seqs=k.max_num_seqs,
                               speculative_method=k.speculative_method,
                               itl_target_s=k.itl_target_ms / 1e3)
        budget = k.max_num_batched_tokens
        scheduled: set[str] = set()
        if k.queue_policy == "priority" and self.waiting and self.running:
            preempt.preempt_for_arrival(self, plan, now)
        for_arrival = len(plan.preempted)  # these make room for an admission this step
        # Decodes first, then running prefills, each in admission order.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:  # Request.is_decoding, inlined: this runs for every request
            out = r.output_token_ids
            if out and len(r.prompt_token_ids) + len(out) - r.num_computed_tokens == 1:
                decodes.append(r)
            else:
                prefills.append(r)
        if self.slots is not None:
            prefills.sort(key=self.slots.slot)
        self._prefilling = prefills
        budget = self._schedule_decodes(decodes, plan, budget, scheduled)
        self._target = StepBudget(self.estimate, plan.chunks, plan.itl_target_s,
                                  self.kv.block_size) if plan.itl_target_s else None
        for req in prefills:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this iteration
            if budget <= 0 or len(scheduled) >= k.max_num_seqs:
                break
            n = self._chunk(req.num_computed_tokens, req.num_pending_tokens, budget)
            if n == 0:
                plan.limit = "ITL target (itl_target_ms): the step has no room for more"
                break
            cows = preempt.make_room(self, req, n, scheduled, plan)
            if cows is None:
                continue
            plan.cow_copies.extend(cows)
            self._add_prefill(plan, req, n)
            scheduled.add(req.request_id)
            budget -= n
        if len(plan.preempted) > for_arrival:
            plan.limit = "KV pool full: running requests were preempted; no admissions"
        elif plan.limit is None:
            budget = self._admit(plan, budget, scheduled, now)
        if plan.limit is None and self.waiting:
            plan.limit = "token budget (max_num_batched_tokens) used up" if budget <= 0 \
                else "sequence limit (max_num_seqs) reached"
        if self.kv.copies:
            plan.transfers = self.kv.take_copies()
        if self.kv.groups:  # the window tables, as they stand once planning is done
            wt = self.kv.window_tables
            for c in plan.chunks:
                c.window_tables = wt.get(c.request_id)
        plan.predicted_s = (self._target or StepTotals(self.estimate, plan.chunks)).seconds()
        return plan

    def _chunk(self, start: int, pending: int, budget: int) -> int:
        """Tokens of a prefill chunk from `start`: at most `pending`, `chunk_size` and the
        token budget, ending at the next of `prompt_cuts`, and under an ITL target what
        keeps the predicted step within it."""
        n = cut_chunk(start, start + pending, min(pending, self.knobs.chunk_size, budget),
                      self._cuts)
        return self._target.cap(start, n) if self._target is not None else n

    def _schedule_decodes(self, decodes: list[Request], plan: SchedulerOutput, budget: int,
                          scheduled: set[str]) -> int:
        """One token for each decoding request, in order, while budgets last.

        The hot path of every iteration: a decode whose next token lands in an unshared,
        partly filled tail block needs no allocation and is planned inline.
        """
        tables = self.kv.tables
        refcount = self.kv.pool.refcount
        p = self.kv.block_size
        max_seqs = self.knobs.max_num_seqs
        chunks = plan.chunks
        running = RequestStatus.RUNNING
        speculate = self.knobs.speculative_method != "off" and self.propose is not None
        drafted = 0
        for req in decodes:
            if budget <= 0 or len(scheduled) >= max_seqs:
                break
            if req.status is not running:
                continue  # preempted to make room for an earlier decode
            rid = req.request_id
            k, draft = self.drafts.draft(req, self.knobs, budget,
                                         self.max_model_len - req.num_tokens - 1,
                                         len(decodes), self.propose) \
                if speculate else (0, ())
            if k:
                # A draft model's tokens come in the step (`ScheduledChunk.draft`).
                cows = preempt.make_room(self, req, 1 + k, scheduled, plan)
                if cows is None:
                    continue
                plan.cow_copies.extend(cows)
                chunks.append(ScheduledChunk(req, 1 + k, req.num_computed_tokens, tables[rid],
                                             True, draft, k))
                scheduled.add(rid)
                budget -= 1 + k
                drafted += k
                continue
            table = tables[rid]
            c = req.num_computed_tokens
            if c % p == 0 or refcount[table[c // p]] != 1:
                cows = preempt.make_room(self, req, 1, scheduled, plan)
                if cows is None:
                    continue
                plan.cow_copies.extend(cows)
            chunks.append(ScheduledChunk(req, 1, c, table, True))
            scheduled.add(rid)
            budget -= 1
        # Verify rows are decode work: one step scores a decoding request's next positions.
        plan.num_decode_tokens += len(chunks) + drafted
        return budget

    def _add_prefill(self, plan: SchedulerOutput, req: Request, n: int) -> None:
        """A prefill chunk of `n` tokens (decodes are planned inline, in _schedule_decodes)."""
        start = req.num_computed_tokens
        if self._target is not None:
            self._target.add(start, n)
        req.events.append((plan.time, f"prefill tokens {start:,}–{start + n:,}"))
        plan.chunks.append(ScheduledChunk(
            req, n, start, self.kv.tables[req.request_id],
            start + n == len(req.prompt_token_ids) + len(req.output_token_ids),
        ))
        plan.num_prefill_tokens += n

    def preemption_mode(self, req: Request) -> str:
        """How `req` would be preempted now: `swap` or `recompute`."""
        return preemption_mode(req, self.knobs.preemption, self.kv, self.estimate)

    def unswap_all(self, now: float, why: str) -> list[str]:
        """Swapped-out requests lose their host copies and will recompute (the host tier
        is being dropped). Returns their ids (`preempt.unswap_all`)."""
        return preempt.unswap_all(self, now, why)

    def preempt_to_fit(self, num_blocks: int, now: float, why: str) -> list[str]:
        """Between steps: preempt running requests until the blocks they hold plus
        reservations fit in `num_blocks`. Returns the ids preempted, in order
        (`preempt.preempt_to_fit`)."""
        return preempt.preempt_to_fit(self, num_blocks, now, why)

    def _admit(self, plan: SchedulerOutput, budget: int, scheduled: set[str],
               now: float) -> int:
        """Admit waiting requests while everything allows; returns the budget left. Sets
        `plan.limit` when something other than the budgets stopped admission."""
        k = self.knobs
        if k.scheduling == "static" and self.running:
            if self.waiting:
                plan.limit = "static batching: the running group finishes first"
            return budget  # a static group runs to completion before the next is admitted
        full = k.reservation == "full"
        for req in queue_order(self.waiting, k, now):
            if budget <= 0 or len(scheduled) >= k.max_num_seqs:
                break
            slot = lora_slot_limit(req, self.running, self.config.max_loras)
            if slot:  # a swapped-out request's adapter needs its slot back too
                plan.limit = slot
                continue
            if req.status is RequestStatus.SWAPPED:
                if not self._swap_in(req, plan, budget, full, now):
                    break
                scheduled.add(req.request_id)
                budget -= plan.chunks[-1].num_new_tokens
                continue
            never = never_fits(req, full, self.kv, k.chunk_size)
            if never:
                self.waiting.remove(req)
                self.reject(req, never, now)
                plan.rejected.append(req.request_id)
                continue
            if self.slots is not None:
                req.remote_kv_tokens = self.slots.reuse(req, self._cuts)
            chain = self.kv.prefix_chain(req)
            hit = max(len(chain) * self.kv.block_size, req.remote_kv_tokens)
            if k.prefix_wait and k.enable_prefix_caching:
                holder = self._prefilling_next_block(req, hit)
                if holder is not None:
                    plan.limit = (f"prefix wait (prefix_wait): {req.request_id} waits for "
                                  f"{holder.request_id} to compute the prompt blocks they "
                                  "share")
                    continue
            n = self._chunk(hit, req.num_tokens - hit, budget)
            if n == 0:
                plan.limit = "ITL target (itl_target_ms): the step has no room for more"
                break
            if k.admission_control and (req.deadline is not None or self._deadlines()):
                finish, miss = self.deadlines.judge(req, hit, self.running, now, k)
                if miss is None:
                    # The latest forecast of every request it shares the batch with.
                    for r in self.running:
                        r.predicted_finish = finish.get(r.request_id, r.predicted_finish)
                    plan.forecasts.update(finish)
                else:
                    if k.on_deadline_miss == "wait":
                        plan.limit = "admission control: waiting requests would miss their " \
                                     "deadlines"
                        continue
                    self.waiting.remove(req)
                    self.reject(req, miss, now)
                    plan.rejected.append(req.request_id)
                    continue
                req.predicted_finish = finish.get(req.request_id, now)
            if not self.kv.can_admit(req, n, full, chain):
                # Head-of-line: wait for blocks rather than let smaller ones pass.
                plan.limit = (f"KV pool full: the next request needs blocks for "
                              f"{req.max_total_tokens if full else hit + n:,} tokens, "
                              f"{self.kv.num_available_blocks():,} blocks are available")
                break
            self.waiting.remove(req)
            plan.cow_copies.extend(self.kv.admit(req, n, full))
            req.events.append((now, f"admitted, {req.num_cached_tokens:,} tokens cached"))
            req.status = RequestStatus.RUNNING
            if req.admitted_time is None:
                req.admitted_time = now
            self.running.append(req)
            self._prefilling.append(req)
            self._add_prefill(plan, req, n)
            plan.admitted.append(req.request_id)
            scheduled.add(req.request_id)
            budget -= n
        return budget

    def _prefilling_next_block(self, req: Request, hit: int) -> Request | None:
        """A running request that has yet to compute the block `req` would compute first
        (tokens `[hit, hit + p)`) and shares every token before it with `req`, if one
        does; `hit` is what the cache gives `req` now. Only requests still prefilling
        this step are looked at (few, even when thousands decode)."""
        end = hit + self.kv.block_size
        if not self._prefilling or end > req.num_tokens - 1:
            return None  # nobody prefills, or no full block is left that it could share
        mine = req.token_slice(0, end)
        for r in self._prefilling:
            if r is not req and r.num_computed_tokens < end <= r.num_tokens and \
                    r.status is RequestStatus.RUNNING and r.token_slice(0, end) == mine \
                    and r.sampling.lora == req.sampling.lora:  # another adapter's: no use
                return r
        return None

    def _swap_in(self, req: Request, plan: SchedulerOutput, budget: int, full: bool,
                 now: float) -> bool:
        """Readmit a swapped-out request (its blocks come back before the forward pass);
        False, with `plan.limit` set, when the pool cannot take them yet."""
        n = self._chunk(req.num_computed_tokens, req.num_tokens - req.num_computed_tokens,
                        budget)
        kv = self.kv
        if n == 0:
            plan.limit = "ITL target (itl_target_ms): the step has no room for more"
            return False
        if not kv.swaps.can_swap_in(req, n, full):
            plan.limit = (f"KV pool full: swapped-out {req.request_id} needs "
                          f"{kv.swaps.swap_in_blocks(req, n, full):,} blocks to come back, "
                          f"{kv.num_available_blocks():,} are available")
            return False
        self.waiting.remove(req)
        num_blocks = len(kv.host_tables[req.request_id])
        plan.cow_copies.extend(kv.swaps.swap_in(req, n, full))
        req.events.append((now, f"swapped in: {num_blocks:,} blocks copied back"))
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.admitted.append(req.request_id)
        start = req.num_computed_tokens
        if n == 1 and req.output_token_ids:  # it was decoding: a decode row again
            plan.chunks.append(ScheduledChunk(req, 1, start, kv.tables[req.request_id], True))
            plan.num_decode_tokens += 1
        else:
            self._add_prefill(plan, req, n)
        return True

    def _deadlines(self) -> bool:
        return any(r.deadline is not None for r in self.running)

    # -- applying results -------------------------------------------------------------------

    def update(self, plan: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled tokens, finish
        requests that stopped, cache newly full blocks. Returns requests finished now."""
        done: list[Request] = []
        errors = result.errors
        p = self.kv.block_size
        emitted = 0
        tokens = plan.num_decode_tokens + plan.num_prefill_tokens
        per_token = result.timing.seconds / tokens if tokens else 0.0
        for chunk in plan.chunks:
            req = chunk.request
            if errors and req.request_id in errors:
                self.running.remove(req)
                req.error = errors[req.request_id]
                self._finish(req, RequestStatus.ABORTED, f"executor error: {req.error}", now)
                done.append(req)
                continue
            start = chunk.start
            end = start + chunk.num_new_tokens
            req.num_computed_tokens = end
            # Its share of the step (`Occupancy.charge`, inlined: this loop runs per row).
            occ, n = req.occupancy, chunk.num_new_tokens
            if n - chunk.num_draft == 1 and start >= len(req.prompt_token_ids):
                occ.decode_s += n * per_token
                occ.decode_calls += 1
            else:
                occ.prefill_s += n * per_token
                occ.prefill_new += n
            if result.prompt_logprobs:
                req.prompt_logprobs_out.extend(result.prompt_logprobs.get(req.request_id, ()))
            status = None
            if chunk.num_draft:
                status, end = self._apply_draft(chunk, result.spec[req.request_id], now,
                                                result.timing.seconds)
            elif chunk.sample:
                branches = chunk.branches
                if branches:  # the prompt is in: its other samples start from it
                    self._start_branches(req, branches, result, now)
                    done.extend(b for b in branches if b.status.is_finished)
                chunk.emitted = 1
                status = self._take_token(req, result, now)
            emitted += chunk.emitted
            if end // p != start // p:  # a block was completed: it may enter the cache
                self.kv.cache_computed(req)
            if self.kv.groups:  # after any rollback: the window of its next position
                self.kv.slide(req)
            if self.kv.eviction.on:  # after any rollback too
                self.kv.evict_tokens(req, result.attention.get(req.request_id))
            if status is not None:
                self.running.remove(req)
                self._finish(req, status, finish_reason(req, status), now)
                done.append(req)
        if emitted:
            self.drafts.last_step = (result.timing.seconds, emitted)
        return done

    def _take_token(self, req: Request, result: StepResult, now: float) -> RequestStatus | None:
        """Append the token sampled for `req` (and its logprobs); its stop status."""
        token = result.sampled[req.request_id]
        req.output_token_ids.append(token)
        if result.logprobs:
            lp = result.logprobs.get(req.request_id)
            if lp is not None:
                req.output_logprobs.append(lp)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
            req.events.append((now, "first token"))
        return stop_after(req, token, self.eos_token_ids, self.max_model_len)

    def _apply_draft(self, chunk: ScheduledChunk, tokens: list[int], now: float,
                     seconds: float) -> tuple[RequestStatus | None, int]:
        """Append a speculating chunk's emitted tokens (accepted drafts, then the target's
        token) until one stops the request; roll the KV back to the positions that hold
        accepted tokens, releasing blocks past them. Returns (final status or None, tokens
        whose KV is valid)."""
        req = chunk.request
        out = req.output_token_ids
        status = None
        emitted = 0
        for token in tokens:
            out.append(token)
            req.token_times.append(now)
            emitted += 1
            status = stop_after(req, token, self.eos_token_ids, self.max_model_len)
            if status is not None:
                break  # tokens after a stop are never emitted, as without speculation
        chunk.emitted = emitted
        k = chunk.num_draft
        accepted = min(emitted - 1, k)
        self.spec.on_round(k, accepted, emitted, seconds)
        self.drafts.on_verified(req.request_id, k, accepted)
        chunk_result = chunk.start + emitted  # the input token and the accepted drafts
        if status is None:
            # Rejected positions' KV is garbage past `chunk_result`: whole blocks past it
            # are released; slots inside the kept tail block are overwritten when used.
            self.kv.truncate(req, chunk_result)
        req.num_computed_tokens = chunk_result
        return status, chunk_result

    # -- views ------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def take_branched(self) -> list[tuple[Request, Request]]:
        """Branches started since the last call (`_start_branches`)."""
        started, self.branched = self.branched, []
        return started

    def take_unstarted(self) -> list[Request]:
        """Samples (`n` > 1) that ended with their request before they started."""
        ended, self.unstarted = self.unstarted, []
        return ended

    def take_dropped(self) -> dict[str, int]:
        """Requests whose KV went since the last call, with the positions each had
        computed (`preempt.py`; the step record keeps them for the waste count)."""
        dropped, self.dropped = self.dropped, {}
        return dropped

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done
