"""One iteration's plan: who runs, how many tokens each, who waits, who is preempted.

Continuous batching under two budgets, tokens per iteration and sequences per iteration:

1. running requests in the decode phase get one token each, first;
2. running requests still prefilling (a chunked prompt, or recomputation after preemption)
   get chunks of at most `chunk_size` tokens from what budget is left;
3. waiting requests are admitted in queue-policy order while both budgets, the KV pool and
   (with admission control) their deadlines allow. Admission stops at the first request that
   does not fit, so a large request is not starved by smaller ones behind it.

With an inter-token-latency target (`itl_target_ms`), prefill chunks in steps 2 and 3 are
also capped so the step's predicted time stays within it (`step_budget.py`).

In `static` mode a group is admitted only when nothing runs, and runs until every member
has finished.

Preemption (`recompute`): when a running request cannot get the blocks it needs, the
victim is the running request, not yet scheduled this iteration, that was admitted last
(under the `priority` policy: the lowest-priority one, latest admitted among equals) — the
request that has received the least service, as in vLLM. Its blocks are freed and it returns
to the head of the queue; its prompt and generated tokens are recomputed when it is
readmitted (reusing whatever the prefix cache still holds). If the request needing blocks is
itself the only candidate, it is the one preempted. No admissions happen in an iteration
that preempted.

Priority preemption on arrival: under the `priority` policy, when the queue's first request
cannot start (the pool cannot take its first chunk, or `max_num_seqs` requests run), running
requests of a strictly lower priority are preempted for it — lowest priority first, latest
admitted among equals — until it fits (`_preempt_for_arrival`). The bound that keeps a
stream of high-priority arrivals from starving the others: a request is preempted this way
at most `ARRIVAL_PREEMPTIONS` times (after that only a pool shortage can preempt it), and a
request that has waited `priority_max_wait_s` is ordered ahead of every priority, oldest
first, and preempts nobody's way in — so every request is admitted within that wait plus
the service of the aged requests ahead of it, and once admitted loses its place at most
twice to arrivals.

Preemption mode (the `preemption` knob): `recompute` as above; `swap` copies the victim's
computed blocks to the host tier instead (`kv/tiers.py`) and it resumes where it stopped
once they are copied back (`RequestStatus.SWAPPED`); `auto` decides per victim with
`swap_or_recompute`. A victim with nothing computed, or one the host tier cannot take,
recomputes.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.forecast import Job, forecast
from kvdeck.runtime.core.request import Request, RequestStatus
from kvdeck.runtime.core.step_budget import StepBudget, StepTotals
from kvdeck.runtime.core.step_data import ScheduledChunk, SchedulerOutput, StepResult, causal_pairs
from kvdeck.runtime.kv.manager import BlockManager
from kvdeck.runtime.spec.stats import MAX_POSITIONS, SpecStats

Estimator = Callable[[int, int, int], float]
"""(new tokens, causal pairs, context tokens) -> predicted step seconds."""
Proposer = Callable[[Request, int], list[int]]
"""(request, most tokens) -> draft tokens to follow its last token (speculative decoding)."""
DraftEstimator = Callable[[int], float]
"""(rows) -> predicted seconds of one draft-model pass over that many rows."""
ARRIVAL_PREEMPTIONS = 2
"""The most times one request is preempted for a higher-priority arrival."""


def swap_or_recompute(num_tokens: int, block_size: int, bytes_per_block: int,
                      link_seconds: Callable[[int], float], estimate: Estimator
                      ) -> tuple[str, float, float]:
    """`auto` preemption's rule for a victim with `num_tokens` computed tokens: swap when
    copying its blocks out and back, `2 · bytes / link bandwidth`, takes less than
    recomputing them — the time its tokens add to a step, `estimate(L, pairs, L) −
    estimate(0, 0, 0)` (a recompute rides in steps that run anyway, so their fixed cost is
    not its own). Returns (choice, swap seconds, recompute seconds).

    Blocks are copied whole, so a victim with a few tokens pays a whole block each way; on
    a roofline step model a short recompute is nearly free (it fills a memory-bound step's
    idle compute), a long one is not (its cost grows with tokens and causal pairs)."""
    nbytes = -(-num_tokens // block_size) * bytes_per_block
    swap = 2.0 * link_seconds(nbytes)
    recompute = estimate(num_tokens, causal_pairs(num_tokens, 0), num_tokens) \
        - estimate(0, 0, 0)
    return ("swap" if swap < recompute else "recompute"), swap, recompute


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
        self.propose: Proposer | None = None
        """Drafts for speculative decoding (set by the engine from its executor)."""
        self.draft_estimate: DraftEstimator | None = None
        """A draft-model pass's predicted time (set by the engine when the executor has a
        draft model): the draft's share of the draft-length rule's ΔT."""
        self.spec = SpecStats()
        self._acceptance: dict[str, tuple[list[int], list[int]]] = {}
        """Per speculating request: (accepted, tried) per draft position."""
        self._last_step = (0.0, 0)
        """(seconds, tokens emitted) of the latest step: T and N of the draft-length rule."""
        self._prefilling: list[Request] = []
        """Running requests with prompt tokens left to compute, as of this step's plan."""
        self._target: StepBudget | None = None
        """While planning under an ITL target, the step's predicted time so far."""

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
                self._finish(child, status, self._why(child, status), now)

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
        self._acceptance.pop(req.request_id, None)
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
            self._preempt_for_arrival(plan, now)
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
            cows = self._make_room(req, n, scheduled, plan)
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
        token budget, and under an ITL target what keeps the predicted step within it."""
        n = min(pending, self.knobs.chunk_size, budget)
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
            k, draft = self._draft(req, budget, len(decodes)) if speculate else (0, ())
            if k:
                # A draft model's tokens come in the step (`ScheduledChunk.draft`).
                cows = self._make_room(req, 1 + k, scheduled, plan)
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
                cows = self._make_room(req, 1, scheduled, plan)
                if cows is None:
                    continue
                plan.cow_copies.extend(cows)
            chunks.append(ScheduledChunk(req, 1, c, table, True))
            scheduled.add(rid)
            budget -= 1
        # Verify rows are decode work: one step scores a decoding request's next positions.
        plan.num_decode_tokens += len(chunks) + drafted
        return budget

    def _draft(self, req: Request, budget: int, num_decodes: int
               ) -> tuple[int, tuple[int, ...]]:
        """(draft positions, draft tokens) for a decoding request; (0, ()) when it should
        decode one token: it asked for logprobs (they come a token a step) or logit
        processors (penalties, a bias, min_p, min_tokens: each token's scores depend on the
        tokens before it, which a draft would have to replay), or has no room left for more.
        Under `speculative_method = draft` the tokens are left empty: the executor's draft
        model writes them in the step."""
        sp = req.sampling
        if sp.logprobs is not None or sp.processes_logits:
            return 0, ()
        k = min(self.knobs.num_speculative_tokens, sp.max_tokens - len(req.output_token_ids) - 1,
                self.max_model_len - req.num_tokens - 1, budget - 1)
        if k <= 0:
            return 0, ()
        model = self.knobs.speculative_method == "draft"
        draft = () if model else tuple(self.propose(req, k)[:k])
        most = k if model else len(draft)
        # Adaptive lengths follow measured step times; a seeded request promises the same
        # output every run, so it keeps the fixed length (its draws depend on it).
        if most and self.knobs.draft_length == "adaptive" and sp.seed is None:
            most = self.draft_length(req, most, num_decodes if model else 0)
        return most, draft[:most]

    def draft_length(self, req: Request, most: int, num_drafting: int = 0) -> int:
        """How many draft tokens `req` should verify this step, at most `most`: lengthen
        while `ΔT/ΔN < T/N` — ΔT the time one more verify row adds to a step (the timing
        model at the request's context), ΔN the chance that row's token is kept (the
        product of the request's acceptance rates up to it, smoothed toward a prior:
        `(accepted + 2·prior)/(tried + 2)` per position, the prior being all requests'
        rate at that position, or where none was tried the rate at the one before), and T/N
        the latest step's time per token emitted.
        With a draft model (`num_drafting` requests drafting this step) ΔT also holds the
        draft's share of one more sequential draft pass: `pass(m)/m` over those requests.
        A request whose drafts keep failing early gets shorter drafts, or none."""
        seconds, tokens = self._last_step
        if not tokens:
            return most  # nothing measured yet
        ctx = req.num_tokens
        row = self.estimate(1, causal_pairs(1, ctx), ctx) - self.estimate(0, 0, 0)
        if num_drafting and self.draft_estimate is not None:
            row += self.draft_estimate(num_drafting) / num_drafting
        per_token = seconds / tokens
        accepted, tried = self._acceptance.get(req.request_id, ((), ()))
        spec = self.spec
        keep, prior = 1.0, 0.5
        for i in range(most):
            # The prior for position i: every request's rate there, else the rate at i − 1.
            # (A fixed 1/2 for untried positions never lets a short draft grow: a position
            # that is never drafted is never tried.)
            if spec.drafts_per_pos[i]:
                prior = (spec.accepted_per_pos[i] + 1) / (spec.drafts_per_pos[i] + 2)
            a, t = (accepted[i], tried[i]) if i < len(tried) else (0, 0)
            rate = (a + 2 * prior) / (t + 2)
            keep *= rate
            prior = rate
            if row / keep >= per_token:
                return i
        return most

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

    def _make_room(self, req: Request, n: int, scheduled: set[str],
                   plan: SchedulerOutput) -> list[tuple[int, int]] | None:
        """Grow `req` by `n` tokens, preempting others as needed; returns the copy-on-write
        pairs, or None if `req` itself had to be preempted."""
        while True:
            cows = self.kv.try_allocate(req, n)
            if cows is not None:
                return cows
            victim = self._pick_victim(scheduled)
            self._preempt(victim, plan)
            if victim is req:
                return None

    def _preempt_for_arrival(self, plan: SchedulerOutput, now: float) -> None:
        """Under `priority`: preempt lower-priority running requests until the queue's first
        request can start (see the module docstring for the bound)."""
        k = self.knobs
        head = min(self.waiting, key=self._priority_key(now))  # the queue's first, no sort
        if head.status is not RequestStatus.WAITING or \
                now - head.arrival_time >= k.priority_max_wait_s:
            return  # resumed requests and aged ones take their turn without preempting
        full = k.reservation == "full"
        if self._never_fits(head, full):
            return
        while True:
            chain = self.kv.prefix_chain(head)  # preempted blocks may have been cached ones
            n = min(head.num_tokens - len(chain) * self.kv.block_size, k.chunk_size,
                    k.max_num_batched_tokens)
            if len(self.running) < k.max_num_seqs and self.kv.can_admit(head, n, full, chain):
                return
            victims = [(i, r) for i, r in enumerate(self.running)
                       if r.priority > head.priority
                       and r.num_arrival_preemptions < ARRIVAL_PREEMPTIONS]
            if not victims:
                return
            _, victim = max(victims, key=lambda ir: (ir[1].priority, ir[0]))
            victim.num_arrival_preemptions += 1
            swap = self.preemption_mode(victim) == "swap"
            self._preempt_now(victim, now, f"for higher-priority {head.request_id} "
                                           f"(priority {head.priority} < {victim.priority})"
                              + ("" if swap else "; blocks freed, to be recomputed"), swap)
            if swap:
                plan.swapped.append(victim.request_id)
            plan.preempted.append(victim.request_id)

    def _pick_victim(self, scheduled: set[str]) -> Request:
        # `running` is in admission order, so a larger index means admitted later.
        candidates = [(i, r) for i, r in enumerate(self.running)
                      if r.request_id not in scheduled]
        if self.knobs.queue_policy == "priority":
            return max(candidates, key=lambda ir: (ir[1].priority, ir[0]))[1]
        return candidates[-1][1]

    def _preempt(self, req: Request, plan: SchedulerOutput) -> None:
        swap = self.preemption_mode(req) == "swap"
        self._preempt_now(req, plan.time, swap=swap)
        if swap:
            plan.swapped.append(req.request_id)
        plan.preempted.append(req.request_id)

    def preemption_mode(self, req: Request) -> str:
        """How `req` would be preempted now: `swap` or `recompute` (see the module
        docstring)."""
        mode = self.knobs.preemption
        kv = self.kv
        if mode == "recompute" or not kv.can_swap_out(kv.blocks_needed(req.num_computed_tokens)):
            return "recompute"
        if mode == "swap":
            return "swap"
        return swap_or_recompute(req.num_computed_tokens, kv.block_size, kv.bytes_per_block,
                                 kv.link_seconds, self.estimate)[0]

    def _preempt_now(self, req: Request, now: float,
                     why: str = "blocks freed, to be recomputed", swap: bool = False) -> None:
        """Take `req` out of the batch to the head of the queue: its blocks freed (it
        recomputes), or with `swap` its computed blocks copied to the host tier first (it
        resumes where it stopped)."""
        self.running.remove(req)
        if swap:
            n = self.kv.swap_out(req)
            req.status = RequestStatus.SWAPPED
            why = f"{n:,} blocks swapped out to the host"
            self.num_swapped += 1
        else:
            self.kv.release(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.events.append((now, f"preempted: {why}"))
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def unswap_all(self, now: float, why: str) -> list[str]:
        """Swapped-out requests lose their host copies and will recompute (the host tier
        is being dropped). Returns their ids."""
        out = []
        for req in self.waiting:
            if req.status is RequestStatus.SWAPPED:
                self.kv.unswap(req)
                req.status = RequestStatus.PREEMPTED
                req.num_computed_tokens = 0
                req.events.append((now, f"host copy dropped ({why}): to be recomputed"))
                out.append(req.request_id)
        return out

    def preempt_to_fit(self, num_blocks: int, now: float, why: str) -> list[str]:
        """Between steps: preempt running requests (the scheduler's usual victims, latest
        admitted first) until the blocks they hold plus reservations fit in `num_blocks`.
        Returns the ids preempted, in order."""
        out: list[str] = []
        kv = self.kv
        while self.running and kv.pool.num_held + kv.num_reserved > num_blocks:
            victim = self._pick_victim(set())
            self._preempt_now(victim, now, why)
            out.append(victim.request_id)
        return out

    def _queue_order(self, now: float) -> list[Request]:
        policy = self.knobs.queue_policy
        if policy == "fcfs":
            # Preempted requests were put at the head. Only the front of a long queue can be
            # admitted this iteration, so copy no more than that.
            return list(itertools.islice(self.waiting, self.knobs.max_num_seqs + 256))
        if policy == "priority":
            return sorted(self.waiting, key=self._priority_key(now))
        back = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
        resumed = [r for r in self.waiting if r.status in back]
        fresh = [r for r in self.waiting if r.status not in back]
        if policy == "edf":
            fresh.sort(key=lambda r: (r.deadline if r.deadline is not None else math.inf,
                                      r.arrival_time))
        else:  # sjf with aging: requests past the wait limit go first, oldest first
            limit = self.knobs.sjf_max_wait_s
            fresh.sort(key=lambda r: (0, r.arrival_time, 0) if now - r.arrival_time >= limit
                       else (1, r.num_prompt_tokens, r.arrival_time))
        return resumed + fresh

    def _priority_key(self, now: float) -> Callable[[Request], tuple]:
        """Queue order under `priority`: requests that waited `priority_max_wait_s` first,
        oldest first; then by priority, resumed ones ahead of fresh ones of the same
        priority, then by arrival."""
        limit = self.knobs.priority_max_wait_s
        back = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
        return lambda r: ((0, r.arrival_time, 0, 0) if now - r.arrival_time >= limit else
                          (1, r.priority, 0 if r.status in back else 1, r.arrival_time))

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
        for req in self._queue_order(now):
            if budget <= 0 or len(scheduled) >= k.max_num_seqs:
                break
            if req.status is RequestStatus.SWAPPED:
                if not self._swap_in(req, plan, budget, full, now):
                    break
                scheduled.add(req.request_id)
                budget -= plan.chunks[-1].num_new_tokens
                continue
            never = self._never_fits(req, full)
            if never:
                self.waiting.remove(req)
                self.reject(req, never, now)
                plan.rejected.append(req.request_id)
                continue
            chain = self.kv.prefix_chain(req)
            hit = len(chain) * self.kv.block_size
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
                finish, miss = self._forecast_with(req, hit, now)
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
            req.events.append((now, f"admitted, {req.num_cached_tokens:,} tokens from the "
                                    "prefix cache"))
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
                    r.status is RequestStatus.RUNNING and r.token_slice(0, end) == mine:
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
        if not kv.can_swap_in(req, n, full):
            plan.limit = (f"KV pool full: swapped-out {req.request_id} needs "
                          f"{kv.swap_in_blocks(req, n, full):,} blocks to come back, "
                          f"{kv.num_available_blocks():,} are available")
            return False
        self.waiting.remove(req)
        num_blocks = len(kv.host_tables[req.request_id])
        plan.cow_copies.extend(kv.swap_in(req, n, full))
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

    def _never_fits(self, req: Request, full: bool) -> str | None:
        """A reason the request can never be admitted with this pool, or None."""
        tokens = req.max_total_tokens if full else req.num_tokens
        need = self.kv.pages_for(tokens, self.knobs.chunk_size, full)
        if need > self.kv.num_blocks:
            what = "prompt + max_tokens − 1" if full else "its prompt"
            unit = "pages (full-attention and window blocks)" if self.kv.groups else "blocks"
            return (f"needs {need:,} KV {unit} for {what} ({tokens:,} tokens) but the pool "
                    f"has {self.kv.num_blocks:,} {unit.split()[0]} of "
                    f"{self.kv.block_size} tokens")
        return None

    def _deadlines(self) -> bool:
        return any(r.deadline is not None for r in self.running)

    @staticmethod
    def _job(r: Request, computed: int | None = None) -> Job:
        """`r` as the forecast sees it (`computed`: its tokens reused at admission)."""
        return Job(r.request_id, r.num_computed_tokens if computed is None else computed,
                   r.num_tokens, r.sampling.max_tokens - r.num_output_tokens, r.deadline)

    def _forecast(self, jobs: list[Job], now: float) -> dict[str, float]:
        k = self.knobs
        return forecast(jobs, now, self.estimate, token_budget=k.max_num_batched_tokens,
                        chunk_size=k.chunk_size, max_num_seqs=k.max_num_seqs,
                        itl_target_s=k.itl_target_ms / 1e3, block_size=self.kv.block_size)

    def _forecast_with(self, req: Request, hit: int, now: float
                       ) -> tuple[dict[str, float], str | None]:
        """(predicted finish of every running request and `req` if it is admitted now, why
        it may not be — None when it and every running request with a deadline are
        forecast to finish in time). The forecast runs the running batch, this step's
        admissions included, plus `req` forward on the timing model (`forecast.py`). A
        running request forecast to miss even without the newcomer (admitted before
        admission control was on) does not block admissions."""
        jobs = [self._job(r) for r in self.running]
        finish = self._forecast([*jobs, self._job(req, hit)], now)
        mine = finish.get(req.request_id, now)
        if req.deadline is not None and mine > req.deadline:
            return finish, (f"cannot meet its deadline: forecast finish "
                            f"{mine - req.arrival_time:.2f} s after arrival, deadline "
                            f"{req.deadline - req.arrival_time:.2f} s")
        late = [j for j in jobs if j.deadline is not None and
                finish.get(j.request_id, now) > j.deadline]
        if late:
            alone = self._forecast(jobs, now)
            for j in late:
                if alone.get(j.request_id, now) <= j.deadline:
                    return finish, (f"admitting it would make {j.request_id} miss its "
                                    f"deadline (forecast finish {finish[j.request_id] - now:.2f}"
                                    f" s from now, deadline in {j.deadline - now:.2f} s)")
        return finish, None

    # -- applying results -------------------------------------------------------------------

    def update(self, plan: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled tokens, finish
        requests that stopped, cache newly full blocks. Returns requests finished now."""
        done: list[Request] = []
        errors = result.errors
        p = self.kv.block_size
        emitted = 0
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
            if status is not None:
                self.running.remove(req)
                self._finish(req, status, self._why(req, status), now)
                done.append(req)
        if emitted:
            self._last_step = (result.timing.seconds, emitted)
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
        return self._stop_after(req, token)

    def _stop_after(self, req: Request, token: int) -> RequestStatus | None:
        """The stop rules for `token`, just appended to `req`'s output: end of sequence or a
        stop token id, `max_tokens` or the context limit, or a stop string (the detokenizer
        takes the token here). None: the request goes on."""
        sp = req.sampling
        out = req.output_token_ids
        status = None
        if (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif len(out) >= sp.max_tokens or len(req.prompt_token_ids) + len(out) >= \
                self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        det = req.detokenizer
        if det is not None:
            det.push(token)
            if det.stopped_by is not None:
                status = RequestStatus.FINISHED_STOPPED
        guide = req.guide
        if guide is not None and status is None:
            if not guide.commit(token):  # masking prevents this: end it, and say why
                req.error = f"the output left its constraint ({guide.error})"
                status = RequestStatus.ABORTED
            elif guide.finished:  # complete, and nothing may follow but the end
                status = RequestStatus.FINISHED_STOPPED
        return status

    @staticmethod
    def _why(req: Request, status: RequestStatus) -> str:
        """The reason a request that stopped after a token is finished with."""
        return req.error if status is RequestStatus.ABORTED and req.error else status.value

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
            status = self._stop_after(req, token)
            if status is not None:
                break  # tokens after a stop are never emitted, as without speculation
        chunk.emitted = emitted
        k = chunk.num_draft
        accepted = min(emitted - 1, k)
        self.spec.on_round(k, accepted, emitted, seconds)
        acc, tried = self._acceptance.setdefault(req.request_id, ([0] * MAX_POSITIONS,
                                                                  [0] * MAX_POSITIONS))
        for i in range(min(accepted + 1, k)):  # positions actually judged
            tried[i] += 1
            acc[i] += i < accepted
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

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done
