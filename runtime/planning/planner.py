"""The planner: capacity, deadline and cost of serving schemes, computed before anything runs.

From a hardware profile, a model profile and a workload (`runtime/planning/workloads.py`) it works
out, with the formulas of docs/architecture.md ("The model behind the numbers"):

- KV bytes per token per format, blocks per request after prefill and after the whole
  output (block-rounded; sliding-window layers counted as their window), and how many
  requests fit the KV budget at once, with and without prefix sharing;
- bytes read per decode step `D(b, L) = D_w + b·L·k` and the batch at which KV reads overtake
  weight reads, `ceil(D_w / (L·k))`; step time along the card's measured decode curve, by
  the fitted model or by the roofline (`step_time.py`);
- for every scheme (baseline, shared prefix, q8_0 / q4_0 KV, speculative decoding per draft
  source, weight offload over the host link, and their combinations): device memory, TTFT
  and completion time for the workload, whether it fits the budget and meets the deadline
  (and by how much it misses), and accelerator-seconds and energy per good result;
- the verdict: the cheapest feasible scheme whose times leave no cost out (a KV format's
  unmeasured conversion), and when none is feasible, what would make one feasible (more
  memory, a later deadline, shorter outputs, a better draft source).

Time runs on `runtime/planning/step_time.py`, the sim executor's own step model, so a plan and a sim
run of the same workload agree by construction; docs/planner.md says where they differ.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.formats import blocks_for_tokens
from kvdeck.runtime.planning.parallel import Layout, layout_step_seconds
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.planning.schemes import (
    PLAN_KV_FORMATS,
    Broken,
    Plan,
    Scheme,
    SchemeResult,
)
from kvdeck.runtime.planning.step_time import (
    Measured,
    fitted_seconds,
    graph_reserve,
    padded_rows,
    roofline_seconds,
)
from kvdeck.runtime.planning.workloads import (
    DraftSource,
    Workload,
    constant_acceptance,
)

TIMINGS = ("auto", "measured", "fit", "roofline")
OFFLOAD_BUFFERS = 2
"""Prefetch buffers for offloaded layers: two overlap copy and compute."""


class Planner:
    """Plans one workload on one card and model (see the module docstring)."""

    def __init__(self, hardware: HardwareProfile, model: ModelProfile, workload: Workload,
                 kv_budget_bytes: float, deadline_s: float | None = None,
                 drafts: list[DraftSource] | None = None, block_size: int = 16,
                 max_batched_tokens: int = 8192, timing: str = "auto",
                 graph_buckets: tuple[int, ...] = (), layout: Layout = Layout()):
        """`timing`: `measured` (the card's measured decode steps as a curve in the bytes a
        step reads, `step_time.Measured`), `fit` (the model profile's fitted step for this
        card), `roofline`, or `auto` (measured, else the fit, else the roofline, as the
        profiles allow). `graph_buckets`: execution shapes (CUDA-graph batch sizes): a step
        of at most the largest runs padded to the next, the padding priced as rows.
        `layout`: the cards one replica spans; beyond one card steps are priced by the
        roofline across them (`parallel.layout_step_seconds`)."""
        self.hw, self.model, self.workload = hardware, model, workload
        self.budget = float(kv_budget_bytes)
        self.deadline = workload.deadline_s if deadline_s is None else deadline_s
        self.drafts = list(drafts or [])
        self.block_size = block_size
        self.max_batched_tokens = max_batched_tokens
        if workload.prompt_tokens + workload.output_tokens > model.context_length:
            raise ConfigError(f"The workload {workload.name}'s requests ({workload.prompt_tokens}"
                              f" + {workload.output_tokens} tokens) exceed {model.name}'s "
                              f"context of {model.context_length:,} tokens.")
        self.fit = model.fits.get(hardware.name)
        self.measured = Measured.of(model, hardware)
        if timing not in TIMINGS:
            raise ConfigError(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}.")
        self.layout = layout
        if layout.cards > 1 and timing in ("measured", "fit"):
            raise ConfigError(f"{layout.name} is priced by the roofline across its cards (a "
                              f"{timing} step model is one card's); use --timing roofline or "
                              "auto.")
        if layout.cards > 1:
            timing = "roofline"
        if timing == "auto":
            timing = "measured" if self.measured is not None else \
                "fit" if self.fit is not None else "roofline"
        if (timing == "measured" and self.measured is None) or \
                (timing == "fit" and self.fit is None):
            raise ConfigError(f"Model profile {model.name} has no {timing} step model for "
                              f"{hardware.name}; use another timing, or kvdeck calibrate on "
                              "that card.")
        self.timing = timing
        self.graph_buckets = tuple(graph_buckets)

    # -- memory -------------------------------------------------------------------------

    def kv_bytes_per_token(self, kv_format: str) -> int:
        return self.model.kv_bytes_per_token(kv_format)

    def seq_bytes(self, num_tokens: int, kv_format: str) -> int:
        """KV bytes one sequence of `num_tokens` holds, block-rounded."""
        return self.model.kv_bytes(num_tokens, self.block_size, kv_format)

    def blocks(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    @property
    def final_tokens(self) -> int:
        return self.workload.final_tokens

    @property
    def shared_blocks(self) -> int:
        """Full blocks of the shared prefix: only full blocks are shared; its partial tail
        block is each request's own."""
        return self.workload.shared_prefix_tokens // self.block_size

    def kv_for(self, n: int, kv_format: str, shared: bool, extra_tokens: int = 0) -> int:
        """KV bytes of `n` requests at their full length (+ `extra_tokens` each, a
        speculative round's drafts): with sharing the prefix's full blocks are held once.
        Sliding-window layers hold a window, so the prefix is shared only by global ones."""
        one = self.seq_bytes(self.final_tokens + extra_tokens, kv_format)
        if not shared or n == 0:
            return n * one
        prefix = self.shared_blocks * self.block_size
        global_layers = self.model.num_layers - self.model.num_local_layers
        saved_per_request = prefix * global_layers * \
            self.model.kv_bytes_per_layer_token(kv_format)
        return n * one - (n - 1) * saved_per_request

    def capacity(self, kv_format: str, shared: bool, budget: float | None = None) -> int:
        """Requests at full length the budget holds at once."""
        budget = self.budget if budget is None else budget
        first = self.kv_for(1, kv_format, shared)
        if first > budget:
            return 0
        # Every request after the first adds the same bytes.
        more = self.kv_for(2, kv_format, shared) - first
        if more <= 0:  # the whole request is shared prefix: any number fit
            return self.workload.num_requests
        return 1 + int((budget - first) // more)

    # -- reads and step time ------------------------------------------------------------

    def read_bytes(self, batch: int, context: int, kv_format: str = "bf16") -> float:
        """`D(b, L) = D_w + b·L·k`: bytes one decode step reads."""
        return self.model.matrix_weight_bytes + batch * context * self.kv_bytes_per_token(
            kv_format)

    def crossover_batch(self, context: int, kv_format: str = "bf16") -> int:
        """The batch at which KV reads overtake weight reads: `ceil(D_w / (L·k))`."""
        return math.ceil(self.model.matrix_weight_bytes
                         / (context * self.kv_bytes_per_token(kv_format)))

    def step_seconds(self, num_new: float, num_pairs: float, num_context: float,
                     kv_format: str = "bf16", timing: str | None = None,
                     num_sampled: float = 0.0) -> float:
        """One step by the chosen timing: `num_new` new tokens, `num_pairs` causal pairs,
        `num_context` KV positions read, `num_sampled` rows through the output head."""
        k = self.kv_bytes_per_token(kv_format)
        timing = timing or self.timing
        if self.graph_buckets:  # the rows the step's execution shape runs
            num_new = padded_rows(math.ceil(num_new), self.graph_buckets)
        if self.layout.cards > 1:
            return layout_step_seconds(self.model, self.hw, self.layout,
                                       self.model.matrix_weight_bytes, k, math.ceil(num_new),
                                       num_pairs, num_context)
        if timing == "measured" and self.measured is not None:
            return self.measured.seconds(self.model, self.hw, self.model.matrix_weight_bytes,
                                         num_context * k, kv_format, num_new, num_pairs)
        if timing == "fit" and self.fit is not None:
            extra = num_context * (k - self.kv_bytes_per_token(self.model.kv_dtype))
            return fitted_seconds(self.fit, self.hw, extra, num_new, num_pairs, num_sampled,
                                  num_context)
        return roofline_seconds(self.model, self.hw, self.model.matrix_weight_bytes, k,
                                num_new, num_pairs, num_context)

    def decode_step(self, batch: int, context: int, kv_format: str = "bf16",
                    timing: str | None = None) -> float:
        """A plain decode step: `batch` rows, each on `context` earlier positions. Measured
        decode steps in the model profile (the reference card's table; `kvdeck calibrate`
        writes them) are interpolated where they cover the batch and context — a CPU's
        decode step is flat, then steep, in the batch, which no linear fit follows — and
        other KV formats move along the measured curve by the bytes they change
        (`measured`) or at the card's bandwidth (`fit`). Every row reads its own context,
        a shared prefix included, as kvdeck's kernels and the sim do (no cascade attention:
        docs/planner.md says what that costs against the chapter's measured 27.35 ms)."""
        timing = timing or self.timing
        rows = batch * (context + 1)
        if timing not in ("fit", "measured"):
            return self.step_seconds(batch, batch * causal_pairs(1, context), rows,
                                     kv_format, timing, batch)
        grid = self.model.decode_seconds(self.hw.name, batch, context)
        k, k0 = self.kv_bytes_per_token(kv_format), self.kv_bytes_per_token(self.model.kv_dtype)
        if timing == "fit":
            if grid is None:
                return self.step_seconds(batch, batch * causal_pairs(1, context), rows,
                                         kv_format, timing, batch)
            extra = rows * (k - k0)
            return max(grid + extra / (self.hw.bandwidth_bytes_per_s * self.hw.mbu),
                       grid * 0.1)
        step = self.step_seconds(batch, batch * causal_pairs(1, context), rows, kv_format,
                                 timing, batch)
        if grid is None:
            return step
        m, w = self.measured, self.model.matrix_weight_bytes
        return max(grid + step - m.seconds(self.model, self.hw, w, rows * k0,
                                           self.model.kv_dtype, batch,
                                           batch * causal_pairs(1, context)), 0.0)

    # -- one scheme ---------------------------------------------------------------------

    def _prefill(self, n: int, scheme: Scheme) -> float:
        """Seconds until the last of `n` requests arriving together has its first token, as
        continuous batching with chunked prefill runs them: each step's token budget goes
        first to one decode row per request already past its prompt, the rest to prompt
        tokens in arrival order; with sharing the prefix's full blocks are computed once
        (by the first request). Each step is priced with its new tokens, causal pairs,
        KV read and sampled rows."""
        w = self.workload
        prefix = self._prefix(scheme)
        own = w.prompt_tokens - prefix
        new = self.prefill_tokens(n, scheme)
        warm = self._warm(scheme)
        first = own if warm else w.prompt_tokens  # tokens until the first prompt is in
        pairs = (n if warm else n - 1) * causal_pairs(own, prefix) \
            + (0 if warm else causal_pairs(w.prompt_tokens, 0))
        budget = self.max_batched_tokens
        computed, done, step, seconds = 0, 0, 0, 0.0
        while computed < new:
            # Decode rows go first but leave room for prompt tokens (as the engine's
            # chunking always makes progress).
            chunk = min(new - computed, max(budget - done, budget // 2, 1))
            computed += chunk
            # Requests whose prompt is complete: the first after its tokens, each next after
            # P − prefix more (all at once when the prompt is all shared prefix).
            if computed < first:
                finished = 0
            elif own == 0:
                finished = n
            else:
                finished = min(n, 1 + (computed - first) // own)
            seconds += self.step_seconds(
                chunk + done, pairs * chunk / new + done * (w.prompt_tokens + step + 1),
                min(n, finished + 1) * w.prompt_tokens + done * step, scheme.kv_format,
                num_sampled=finished)  # prefills completed now, and the decode rows
            done, step = finished, step + 1
        if scheme.draft is not None:
            seconds *= 1 + scheme.draft.ttft_overhead
        return seconds

    def _decode(self, n: int, scheme: Scheme) -> tuple[float, float, int]:
        """(seconds for the rest of the output at batch `n`, one step or round at mid
        output, steps or rounds taken)."""
        w, fmt, d = self.workload, scheme.kv_format, scheme.draft
        remaining = w.output_tokens - 1
        if remaining <= 0:
            return 0.0, 0.0, 0
        if d is None:
            total = sum(self.decode_step(n, w.prompt_tokens + j, fmt) for j in range(remaining))
            return total, self.decode_step(n, w.prompt_tokens + remaining // 2, fmt), remaining
        per_round = d.expected_outputs()
        rows = d.draft_length + 1

        def round_seconds(ctx: int) -> float:
            verify = self.step_seconds(n * rows, n * causal_pairs(rows, ctx), n * (ctx + rows),
                                       fmt, num_sampled=n * rows)
            return verify + d.passes() * d.draft_cost * self.decode_step(n, ctx, fmt)

        rounds = math.ceil(remaining / per_round)
        total = sum(round_seconds(w.prompt_tokens + int(r * per_round)) for r in range(rounds))
        return total, round_seconds(w.prompt_tokens + remaining // 2), rounds

    def _offload_bytes(self, deficit: float) -> int:
        """Whole layers' FFN weights to move to the host to free `deficit` bytes (the
        deficit already counts the prefetch buffers); capped at every layer."""
        layer = self.model.ffn_layer_bytes()
        layers = min(self.model.num_layers, math.ceil(deficit / layer))
        return int(layers * layer)

    def evaluate(self, scheme: Scheme) -> SchemeResult:
        w, d = self.workload, scheme.draft
        extra_tokens = d.draft_length if d is not None else 0
        aux = d.extra_memory_bytes if d is not None else 0
        if w.arrival == "burst":
            n = w.num_requests
            ttft = self._prefill(n, scheme)
            decode, step, steps = self._decode(n, scheme)
        else:
            n, ttft, decode, step = self._steady_state(scheme)
            steps = math.ceil(max(0, w.output_tokens - 1)
                              / (d.expected_outputs() if d is not None else 1.0))
        kv = self.kv_for(n, scheme.kv_format, scheme.shared, extra_tokens)
        offloaded = 0
        if scheme.offload:
            layer = self.model.ffn_layer_bytes()
            aux += int(OFFLOAD_BUFFERS * layer)
            offloaded = self._offload_bytes(max(0.0, kv + aux - self.budget))
            # Two buffers overlap copy and compute: a step lasts at least its copies.
            link = self.hw.link_bandwidth_bytes_per_s or self.hw.bandwidth_bytes_per_s
            copy = offloaded / link
            steps = max(1, math.ceil((w.output_tokens - 1) / (
                d.expected_outputs() if d is not None else 1)))
            # An overloaded queue stays overloaded (infinite), however the steps are priced.
            decode = decode if math.isinf(decode) else \
                sum(max(step, copy) for _ in range(steps)) if decode else 0.0
            step = max(step, copy)
            ttft += copy * max(1, math.ceil(self.prefill_tokens(n, scheme)
                                            / self.max_batched_tokens))
        completion = ttft + decode
        if w.arrival == "burst":
            busy, good_if_met = completion, n
        else:
            # Continuous batching keeps the card stepping while requests are resident: per
            # request it spends T/b = 1/λ (Little's law), whatever the scheme.
            busy, good_if_met = w.num_requests / w.rate_per_s, w.num_requests
        result = SchemeResult(scheme, kv, aux, offloaded, n, ttft, completion, step, busy, 0,
                              self.budget, self.deadline, self.hw.power_watts,
                              unpriced=self._unpriced(scheme), steps=steps)
        if result.memory_bytes > self.budget:
            result.broken.append(Broken("memory", result.memory_bytes - self.budget))
        if completion > self.deadline:
            result.broken.append(Broken("deadline", completion - self.deadline))
        result.good = good_if_met if result.feasible else 0
        return result

    def _unpriced(self, scheme: Scheme) -> str:
        """What the scheme's times leave out: under measured timing, a KV format whose
        conversion cost was not measured on the card."""
        if self.timing != "measured" or self.measured.convert_known(scheme.kv_format):
            return ""
        return f"{scheme.kv_format} conversion (not measured on {self.hw.name})"

    def _prefix(self, scheme: Scheme) -> int:
        """Prompt tokens a scheme computes once for every request: the shared prefix's full
        blocks when it shares, else none."""
        return self.shared_blocks * self.block_size if scheme.shared else 0

    def prefill_tokens(self, n: int, scheme: Scheme) -> int:
        """Prompt tokens `n` requests compute: the first all of its prompt (none of the
        prefix when it was cached before they came), the others their prompt past the
        shared prefix."""
        w = self.workload
        own = w.prompt_tokens - self._prefix(scheme)
        return n * own if self._warm(scheme) else w.prompt_tokens + (n - 1) * own

    def _warm(self, scheme: Scheme) -> bool:
        """Whether the scheme finds the shared prefix already cached when requests come."""
        return scheme.shared and self.workload.prefix_cached and self.shared_blocks > 0

    def _steady_state(self, scheme: Scheme) -> tuple[int, float, float, float]:
        """Poisson arrivals at rate λ, served by continuous batching with chunked prefill:
        every step of length τ carries the `b` resident requests' decode rows and the prompt
        tokens that arrived meanwhile (`λ·τ·P_new`). τ and `b` are found together by
        iteration: τ = step(b rows + λτ·P_new tokens), a request stays `T = TTFT + rounds·τ`
        (its prompt over `ceil(P_new / token budget)` steps, then its output), and Little's
        law gives `b = λ·T`. When the prompts arriving per step outgrow the token budget,
        or τ does not settle, the queue grows without bound: completion is infinite.
        Returns (b, TTFT, time from first token to completion, τ)."""
        w, d, fmt = self.workload, scheme.draft, scheme.kv_format
        lam = w.rate_per_s
        prefix = self._prefix(scheme)
        p_new = w.prompt_tokens - prefix
        rows = d.draft_length + 1 if d is not None else 1
        per_round = d.expected_outputs() if d is not None else 1.0
        rounds = math.ceil(max(0, w.output_tokens - 1) / per_round)
        ctx = w.prompt_tokens + w.output_tokens // 2
        prefill_steps = max(1, math.ceil(p_new / self.max_batched_tokens))
        b, tau = 1.0, self.decode_step(1, ctx, fmt)
        for _ in range(200):
            arriving = lam * tau * p_new
            step = self.step_seconds(b * rows + arriving,
                                     b * causal_pairs(rows, ctx)
                                     + lam * tau * causal_pairs(p_new, prefix),
                                     b * (ctx + rows) + lam * tau * w.prompt_tokens, fmt,
                                     num_sampled=b * rows + lam * tau)
            if d is not None:
                step += d.passes() * d.draft_cost * self.decode_step(max(1, round(b)), ctx,
                                                                     fmt)
            ttft = prefill_steps * step * (1 + (d.ttft_overhead if d is not None else 0.0))
            b_next = max(1.0, lam * (ttft + rounds * step))
            if b * rows + arriving > self.max_batched_tokens or step > 1e3:
                return math.ceil(b), ttft, math.inf, step
            settled = abs(step - tau) < 1e-9 and abs(b_next - b) < 1e-6
            tau, b = step, (b + b_next) / 2  # damped: b and τ feed each other
            if settled:
                break
        else:
            return math.ceil(b), ttft, math.inf, tau
        return math.ceil(b), ttft, rounds * tau, tau

    # -- all schemes and the verdict ----------------------------------------------------

    def schemes(self) -> list[Scheme]:
        """Every combination: sharing (when the workload shares a prefix) × KV format ×
        (no draft or each draft source); then each one that breaks the memory budget again
        with weight offload."""
        sharing = (False, True) if self.shared_blocks else (False,)
        return [Scheme(s, f, d) for d in (None, *self.drafts) for s in sharing
                for f in PLAN_KV_FORMATS]

    def plan(self, only: list[Scheme] | None = None) -> Plan:
        """Every scheme (`schemes()`, then those over the memory budget again with weight
        offload), or `only` these, each evaluated; the cheapest feasible one fully priced is
        the choice, and when there is none, what would make one feasible."""
        if only is not None:
            results = [self.evaluate(s) for s in only]
        else:
            results = [self.evaluate(s) for s in self.schemes()]
            results += [self.evaluate(replace(r.scheme, offload=True)) for r in list(results)
                        if any(b.limit == "memory" for b in r.broken)]
        # A scheme whose times leave a cost out is not chosen over one fully priced.
        feasible = [r for r in results if r.feasible and not r.unpriced]
        choice = min(feasible, key=lambda r: (r.accelerator_s_per_good, r.memory_bytes),
                     default=None)
        suggestions = [] if choice is not None else self.suggest(results)
        return Plan(results, choice, suggestions, self.figures())

    def suggest(self, results: list[SchemeResult]) -> list[str]:
        """What would make some scheme feasible: more memory, a later deadline, shorter
        outputs, a draft source that emits more per round. Schemes whose times leave a cost
        out are suggested only when no fully priced scheme is left."""
        results = [r for r in results if not r.unpriced] or results
        out = []
        on_time = [r for r in results if not any(b.limit == "deadline" for b in r.broken)]
        if on_time:
            r = min(on_time, key=lambda r: r.memory_bytes)
            out.append(f"A KV budget of {r.memory_bytes / 2**30:.2f} GiB (now "
                       f"{self.budget / 2**30:.2f}) makes '{r.scheme.name}' feasible.")
        fitting = [r for r in results if not any(b.limit == "memory" for b in r.broken)]
        if fitting:
            r = min(fitting, key=lambda r: r.completion_s)
            if not math.isinf(r.completion_s):
                out.append(f"A deadline of {r.completion_s:.2f} s (now {self.deadline:g}) "
                           f"makes '{r.scheme.name}' feasible.")
            shorter = self._longest_output(r.scheme)
            if shorter:
                out.append(f"Outputs of at most {shorter} tokens (now "
                           f"{self.workload.output_tokens}) make '{r.scheme.name}' feasible.")
            need = self._outputs_per_round_needed(r.scheme)
            if need is not None:
                base = replace(r.scheme, draft=None).name
                out.append(f"A draft source emitting {need:.1f} tokens per round on average "
                           f"(a parallel draft at 10% of a decode step) makes '{base}' "
                           "with that draft feasible.")
        if self.workload.arrival == "poisson":  # fewer arrivals: less memory and waiting
            rate, scheme = max(((self._highest_rate(r.scheme), r.scheme) for r in results),
                               key=lambda x: x[0])
            if rate > 0:
                out.append(f"Arrivals of at most {rate:.3g} req/s (now "
                           f"{self.workload.rate_per_s:g}) make '{scheme.name}' feasible.")
        if not out:
            out.append("No change of one limit makes a scheme feasible: raise the memory "
                       "budget and the deadline together, or shorten the requests.")
        return out

    def _with(self, **changes) -> Planner:
        return Planner(self.hw, self.model, replace(self.workload, **changes), self.budget,
                       self.deadline, self.drafts, self.block_size, self.max_batched_tokens,
                       self.timing, self.graph_buckets, self.layout)

    def _longest_output(self, scheme: Scheme) -> int | None:
        """The most output tokens with which `scheme` is feasible (None: not even one)."""
        lo, hi = 0, self.workload.output_tokens - 1

        def feasible(g: int) -> bool:
            return self._with(output_tokens=g).evaluate(scheme).feasible

        while lo < hi:
            mid = (lo + hi + 1) // 2
            if feasible(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo if lo >= 1 and feasible(lo) else None

    def _highest_rate(self, scheme: Scheme) -> float:
        """The highest Poisson arrival rate at which `scheme` is feasible (0: none above
        1/1000 of today's), to three significant figures."""
        lo, hi = 0.0, self.workload.rate_per_s
        if not self._with(rate_per_s=hi / 1000).evaluate(scheme).feasible:
            return 0.0
        lo = hi / 1000
        while hi - lo > lo * 1e-3:
            mid = (lo + hi) / 2
            if self._with(rate_per_s=mid).evaluate(scheme).feasible:
                lo = mid
            else:
                hi = mid
        return lo

    def _outputs_per_round_needed(self, scheme: Scheme) -> float | None:
        """Mean tokens per round a parallel draft (memory as the scheme's, pass cost 10 %
        of a decode step, 15 positions) would need for `scheme` to meet the deadline; None
        when even 16 per round would not."""
        base = scheme.draft
        for tenths in range(11, 161):
            target = tenths / 10
            rate = constant_acceptance(target, 15)
            d = DraftSource("needed", "", "*", "parallel", 15,
                            base.weight_bytes if base else 0,
                            base.extra_memory_bytes if base else 0,
                            base.ttft_overhead if base else 0.0, 0.1, (rate,) * 15)
            if self.evaluate(replace(scheme, draft=d)).feasible:
                return target
        return None

    def figures(self) -> dict:
        """The plan's worked numbers (per format): KV bytes per token, blocks per request,
        capacity with and without sharing, reads per decode step and the crossover batch."""
        w = self.workload
        n = w.num_requests if w.arrival == "burst" else 1
        ctx = w.prompt_tokens + w.output_tokens // 2
        formats = {}
        for f in PLAN_KV_FORMATS:
            formats[f] = {
                "kv_bytes_per_token": self.kv_bytes_per_token(f),
                "bytes_per_request_full": self.seq_bytes(self.final_tokens, f),
                "capacity": self.capacity(f, False),
                "capacity_shared": self.capacity(f, True) if self.shared_blocks else None,
                "read_bytes_per_decode_step": self.read_bytes(n, ctx, f),
                "crossover_batch": self.crossover_batch(ctx, f),
            }
        return {
            "block_size": self.block_size,
            "blocks_after_prefill": self.blocks(w.prompt_tokens),
            "blocks_after_output": self.blocks(self.final_tokens),
            "shared_blocks": self.shared_blocks,
            "sliding_window": self.model.sliding_window,
            "local_layers": self.model.num_local_layers,
            "formats": formats,
            "timing": self.timing,
            "decode_step_s": {
                "batch": n, "context": ctx,
                "roofline": self.decode_step(n, ctx, timing="roofline"),
                "fit": self.decode_step(n, ctx, timing="fit") if self.fit else None,
                "measured": self.decode_step(n, ctx, timing="measured")
                if self.measured is not None else None,
            },
            "weight_bytes_read_per_step": self.model.matrix_weight_bytes,
            "graph_buckets": list(self.graph_buckets),
            "graph_pool_bytes": graph_reserve(self.model, self.graph_buckets,
                                              self.final_tokens),
        }
