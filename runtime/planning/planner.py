"""The planner: capacity, deadline and cost of serving schemes, computed before anything runs.

From a hardware profile, a model profile and a workload (`runtime/planning/workloads.py`) it works
out, with the formulas of docs/architecture.md ("The model behind the numbers"):

- KV bytes per token per format, blocks per request after prefill and after the whole
  output (block-rounded; sliding-window layers counted as their window), and how many
  requests fit the KV budget at once, with and without prefix sharing;
- bytes read per decode step `D(b, L) = D_w + b·L·k` and the batch at which KV reads overtake
  weight reads, `ceil(D_w / (L·k))`; step time by the roofline and by the fitted model;
- for every scheme (baseline, shared prefix, q8_0 / q4_0 KV, speculative decoding per draft
  source, weight offload over the host link, and their combinations): device memory, TTFT
  and completion time for the workload, whether it fits the budget and meets the deadline
  (and by how much it misses), and accelerator-seconds and energy per good result;
- the verdict: the cheapest feasible scheme, and when none is feasible, what would make one
  feasible (more memory, a later deadline, shorter outputs, a better draft source).

Time runs on `runtime/planning/step_time.py`, the sim executor's own step model, so a plan and a sim
run of the same workload agree by construction; docs/planner.md says where they differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.formats import blocks_for_tokens
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.planning.step_time import fitted_seconds, roofline_seconds
from kvdeck.runtime.planning.workloads import DraftSource, Workload, expected_outputs

PLAN_KV_FORMATS = ("bf16", "q8_0", "q4_0")
"""The KV formats the planner compares (bf16 stands for any 2-byte float format)."""
OFFLOAD_BUFFERS = 2
"""Prefetch buffers for offloaded layers: two overlap copy and compute."""


@dataclass(frozen=True)
class Scheme:
    """One way to serve the workload."""

    shared: bool = False
    kv_format: str = "bf16"
    draft: DraftSource | None = None
    offload: bool = False

    @property
    def name(self) -> str:
        parts = (["shared prefix"] if self.shared else []) \
            + ([f"{self.kv_format} KV"] if self.kv_format != "bf16" else []) \
            + ([f"spec {self.draft.name}"] if self.draft is not None else []) \
            + (["weight offload"] if self.offload else [])
        return " + ".join(parts) or "baseline"


@dataclass(frozen=True)
class Broken:
    """A limit a scheme breaks and by how much (bytes or seconds)."""

    limit: str
    """`memory` or `deadline`."""
    over_by: float

    def describe(self, budget: float, deadline: float) -> str:
        if self.limit == "memory":
            size = f"{self.over_by / 2**30:.2f} GiB" if self.over_by >= 2**30 else \
                f"{self.over_by / 2**20:.1f} MiB"
            share = f" ({100 * self.over_by / budget:.1f}% of the budget)" if budget > 0 else ""
            return f"memory over by {size}{share}"
        if math.isinf(self.over_by):
            return "deadline: arrivals outpace service (the queue grows without bound)"
        share = f" ({100 * self.over_by / deadline:.0f}%)" if deadline > 0 else ""
        return f"deadline missed by {self.over_by:.2f} s{share}"


@dataclass
class SchemeResult:
    """What one scheme costs and whether it holds."""

    scheme: Scheme
    kv_bytes: int
    aux_bytes: int
    """Draft weights and peak buffers, offload prefetch buffers."""
    offloaded_bytes: int
    """Weights moved to the host, freeing that much device memory."""
    concurrency: int
    """Requests resident at once (the burst, or Little's law for Poisson arrivals)."""
    ttft_s: float
    completion_s: float
    decode_step_s: float
    """One decode step (a speculative round's verify + draft) at the plan's batch."""
    busy_s: float
    """Accelerator time the workload takes."""
    good: int
    budget_bytes: float
    deadline_s: float
    power_watts: float
    broken: list[Broken] = field(default_factory=list)

    @property
    def memory_bytes(self) -> int:
        """Device memory beyond the resident weights: KV + auxiliary − offloaded weights
        (offloading whole layers can free more than the rest needs: then 0)."""
        return max(self.kv_bytes + self.aux_bytes - self.offloaded_bytes, 0)

    @property
    def feasible(self) -> bool:
        return not self.broken

    @property
    def accelerator_s_per_good(self) -> float:
        return self.busy_s / self.good if self.good else math.inf

    @property
    def energy_j_per_good(self) -> float:
        """At the profile's power (its limit, or a live draw); NaN where the profile has no
        power figure (a CPU measured here)."""
        if not self.power_watts:
            return math.nan
        return self.accelerator_s_per_good * self.power_watts

    def verdict(self) -> str:
        if self.feasible:
            return "feasible"
        return "; ".join(b.describe(self.budget_bytes, self.deadline_s) for b in self.broken)

    def to_json(self) -> dict:
        def num(x: float) -> float | None:
            return None if math.isinf(x) or math.isnan(x) else x

        return {
            "scheme": self.scheme.name, "shared_prefix": self.scheme.shared,
            "kv_format": self.scheme.kv_format,
            "draft": self.scheme.draft.name if self.scheme.draft else None,
            "weight_offload": self.scheme.offload,
            "memory_bytes": self.memory_bytes, "kv_bytes": self.kv_bytes,
            "aux_bytes": self.aux_bytes, "offloaded_bytes": self.offloaded_bytes,
            "concurrency": self.concurrency, "ttft_s": num(self.ttft_s),
            "completion_s": num(self.completion_s), "decode_step_s": num(self.decode_step_s),
            "feasible": self.feasible,
            "broken": [{"limit": b.limit, "over_by": num(b.over_by)} for b in self.broken],
            "broken_limit": ", ".join(b.limit for b in self.broken) or None,
            "accelerator_s_per_good": num(self.accelerator_s_per_good),
            "energy_j_per_good": num(self.energy_j_per_good),
        }


@dataclass
class Plan:
    """Every scheme's result, the chosen one and, when none is feasible, what would help."""

    results: list[SchemeResult]
    choice: SchemeResult | None
    suggestions: list[str]
    figures: dict


class Planner:
    """Plans one workload on one card and model (see the module docstring)."""

    def __init__(self, hardware: HardwareProfile, model: ModelProfile, workload: Workload,
                 kv_budget_bytes: float, deadline_s: float | None = None,
                 drafts: list[DraftSource] | None = None, block_size: int = 16,
                 max_batched_tokens: int = 8192, timing: str = "auto"):
        """`timing`: `fit` (the model profile's fitted step for this card), `roofline`, or
        `auto` (the fit where the profile has one)."""
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
        self.timing = ("fit" if self.fit is not None else "roofline") if timing == "auto" \
            else timing

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
        """KV positions a request holds after its whole output: `prompt + output − 1` (the
        last token is never written)."""
        w = self.workload
        return w.prompt_tokens + w.output_tokens - 1

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
        if (timing or self.timing) == "fit" and self.fit is not None:
            extra = num_context * (k - self.kv_bytes_per_token(self.model.kv_dtype))
            return fitted_seconds(self.fit, self.hw, extra, num_new, num_pairs, num_sampled)
        return roofline_seconds(self.model, self.hw, self.model.matrix_weight_bytes, k,
                                num_new, num_pairs, num_context)

    def decode_step(self, batch: int, context: int, kv_format: str = "bf16",
                    timing: str | None = None) -> float:
        """A plain decode step: `batch` rows, each on `context` earlier positions. Under the
        fitted timing, measured decode steps in the model profile (`kvdeck calibrate`
        writes them) are interpolated where they cover the batch, other KV formats adjusted
        by the bytes they read, as the fit is: a CPU's decode step is flat, then steep, in
        the batch, which no linear fit follows."""
        if (timing or self.timing) == "fit":
            measured = self.model.decode_seconds(self.hw.name, batch, context)
            if measured is not None:
                extra = batch * (context + 1) * (self.kv_bytes_per_token(kv_format)
                                                 - self.kv_bytes_per_token(self.model.kv_dtype))
                return max(measured + extra / (self.hw.bandwidth_bytes_per_s * self.hw.mbu),
                           measured * 0.1)
        return self.step_seconds(batch, batch * causal_pairs(1, context),
                                 batch * (context + 1), kv_format, timing, batch)

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
        new = self._prefill_tokens(n, scheme)
        pairs = causal_pairs(w.prompt_tokens, 0) + (n - 1) * causal_pairs(own, prefix)
        budget = self.max_batched_tokens
        computed, done, step, seconds = 0, 0, 0, 0.0
        while computed < new:
            # Decode rows go first but leave room for prompt tokens (as the engine's
            # chunking always makes progress).
            chunk = min(new - computed, max(budget - done, budget // 2, 1))
            computed += chunk
            # Requests whose prompt is complete: the first after P tokens, each next after
            # P − prefix more (all at once when the prompt is all shared prefix).
            if computed < w.prompt_tokens:
                finished = 0
            elif own == 0:
                finished = n
            else:
                finished = min(n, 1 + (computed - w.prompt_tokens) // own)
            seconds += self.step_seconds(
                chunk + done, pairs * chunk / new + done * (w.prompt_tokens + step + 1),
                min(n, finished + 1) * w.prompt_tokens + done * step, scheme.kv_format,
                num_sampled=finished)  # prefills completed now, and the decode rows
            done, step = finished, step + 1
        if scheme.draft is not None:
            seconds *= 1 + scheme.draft.ttft_overhead
        return seconds

    def _decode(self, n: int, scheme: Scheme) -> tuple[float, float]:
        """(seconds for the rest of the output at batch `n`, one step or round at mid
        output)."""
        w, fmt, d = self.workload, scheme.kv_format, scheme.draft
        remaining = w.output_tokens - 1
        if remaining <= 0:
            return 0.0, 0.0
        if d is None:
            total = sum(self.decode_step(n, w.prompt_tokens + j, fmt) for j in range(remaining))
            return total, self.decode_step(n, w.prompt_tokens + remaining // 2, fmt)
        per_round = d.expected_outputs()
        rows = d.draft_length + 1

        def round_seconds(ctx: int) -> float:
            verify = self.step_seconds(n * rows, n * causal_pairs(rows, ctx), n * (ctx + rows),
                                       fmt, num_sampled=n * rows)
            return verify + d.passes() * d.draft_cost * self.decode_step(n, ctx, fmt)

        rounds = math.ceil(remaining / per_round)
        total = sum(round_seconds(w.prompt_tokens + int(r * per_round)) for r in range(rounds))
        return total, round_seconds(w.prompt_tokens + remaining // 2)

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
            decode, step = self._decode(n, scheme)
        else:
            n, ttft, decode, step = self._steady_state(scheme)
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
            ttft += copy * max(1, math.ceil(self._prefill_tokens(n, scheme)
                                            / self.max_batched_tokens))
        completion = ttft + decode
        if w.arrival == "burst":
            busy, good_if_met = completion, n
        else:
            # Continuous batching keeps the card stepping while requests are resident: per
            # request it spends T/b = 1/λ (Little's law), whatever the scheme.
            busy, good_if_met = w.num_requests / w.rate_per_s, w.num_requests
        result = SchemeResult(scheme, kv, aux, offloaded, n, ttft, completion, step, busy, 0,
                              self.budget, self.deadline, self.hw.power_watts)
        if result.memory_bytes > self.budget:
            result.broken.append(Broken("memory", result.memory_bytes - self.budget))
        if completion > self.deadline:
            result.broken.append(Broken("deadline", completion - self.deadline))
        result.good = good_if_met if result.feasible else 0
        return result

    def _prefix(self, scheme: Scheme) -> int:
        """Prompt tokens a scheme computes once for every request: the shared prefix's full
        blocks when it shares, else none."""
        return self.shared_blocks * self.block_size if scheme.shared else 0

    def _prefill_tokens(self, n: int, scheme: Scheme) -> int:
        """Prompt tokens `n` requests compute: the first all of its prompt, the others
        their prompt past the shared prefix."""
        w = self.workload
        return w.prompt_tokens + (n - 1) * (w.prompt_tokens - self._prefix(scheme))

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

    def plan(self) -> Plan:
        results = [self.evaluate(s) for s in self.schemes()]
        results += [self.evaluate(replace(r.scheme, offload=True)) for r in list(results)
                    if any(b.limit == "memory" for b in r.broken)]
        feasible = [r for r in results if r.feasible]
        choice = min(feasible, key=lambda r: (r.accelerator_s_per_good, r.memory_bytes),
                     default=None)
        suggestions = [] if choice is not None else self.suggest(results)
        return Plan(results, choice, suggestions, self.figures())

    def suggest(self, results: list[SchemeResult]) -> list[str]:
        """What would make some scheme feasible: more memory, a later deadline, shorter
        outputs, a draft source that emits more per round."""
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
                       self.timing)

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
            rate = self._rate_for(target, 15)
            d = DraftSource("needed", "", "*", "parallel", 15,
                            base.weight_bytes if base else 0,
                            base.extra_memory_bytes if base else 0,
                            base.ttft_overhead if base else 0.0, 0.1, (rate,) * 15)
            if self.evaluate(replace(scheme, draft=d)).feasible:
                return target
        return None

    @staticmethod
    def _rate_for(target: float, m: int) -> float:
        """The constant conditional acceptance `a` with `1 + a + … + a^m = target`."""
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if expected_outputs((mid,) * m) < target:
                lo = mid
            else:
                hi = mid
        return hi

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
            },
            "weight_bytes_read_per_step": self.model.matrix_weight_bytes,
        }
