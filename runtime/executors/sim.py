"""The `sim` executor: a timing model instead of a model, on a virtual clock.

Step time comes from `runtime/planning/step_time.py`, the planner's own model: the card's
measured decode steps as a curve in the bytes a step reads (`measured`, where the model
profile has them), the fitted model `fixed +
per_token × new_tokens + per_pair × pairs` (`fit`), or a roofline `max(F / (P·MFU), (D_w +
Σ L·k) / (β·MBU))` from a hardware and a model profile; `auto` takes the first the profiles
allow. Tokens are deterministic functions of (seed, request id, position), so the same
trace, configuration and seed give byte-identical runs. KV exists only as accounting: an 8B
model on a 96 GB card with hundreds of 8K-token requests runs on a laptop.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.core.step_data import Conversion, SchedulerOutput, StepResult, StepTiming
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.base import ExecutorInfo, WeightsView
from kvdeck.runtime.executors.server_slots import ServerSlots, pass_seconds
from kvdeck.runtime.executors.sim_config import SimConfig
from kvdeck.runtime.executors.sim_draft import draft_seconds
from kvdeck.runtime.kv.formats import KV_FORMATS
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.kv.transfers import Transfer
from kvdeck.runtime.models.weight_formats import (
    GROUPS,
    PARAM_BYTES,
    format_weight_format,
    parse_weight_format,
)
from kvdeck.runtime.planning.parallel import Layout, layout_step_seconds
from kvdeck.runtime.planning.profiles import (
    HardwareProfile,
    ModelProfile,
    StepFit,
    ratio_at,
)
from kvdeck.runtime.planning.step_time import (
    Measured,
    fitted_seconds,
    padded_rows,
    parse_buckets,
    roofline_seconds,
)
from kvdeck.runtime.planning.wake import wake_seconds

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A fast, well-mixed 64-bit hash (used as a stateless random number generator)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class SimExecutor:
    """Executor protocol implementation driven by a timing model."""

    def __init__(self, config: SimConfig = SimConfig(), seed: int = 0,
                 text_tokens: list[int] | None = None):
        """`text_tokens`: a tokenized text to read outputs from (each request from its own
        offset), so that with a real tokenizer the simulated answers are readable text that
        decodes and re-encodes to the same tokens; None draws ids at random."""
        self.config = config
        self.text_tokens = text_tokens
        self.seed = seed
        self.model = ModelProfile.load(config.model_profile)
        self.hardware = HardwareProfile.load(config.hardware)
        self.layout = Layout(config.tensor_parallel, config.pipeline_parallel)
        self.timing = self._resolve_timing()
        self.fit = self._resolve_fit()
        # A trace repeats its step shapes: each shape's correction is worked out once, not
        # in every step. A fit given in the settings is not the one the profile's measured
        # steps correct: it is taken as it is.
        given = (config.fixed_ms, config.per_token_us, config.per_pair_ns) != (None,) * 3
        self._prefill_factor = functools.lru_cache(maxsize=4096)(functools.partial(
            self.model.prefill_factor, "" if given else self.hardware.name, self.fit))
        ratios = {} if given else self.model.decode_ratios(self.hardware.name, self.fit)
        if config.server_slots and self.hardware.name not in self.model.decode_pinned:
            # Behind llama-server's slots, only a probe's one row or every slot's rows surely
            # ran as one pass (`server_slots.py`) where the probes were not pinned to
            # neighbouring slots; two to four ran in one or more as their slots fell, and
            # correct nothing.
            ratios = {b: r for b, r in ratios.items() if b in (1, config.server_slots)}
        self._decode_ratios = ratios
        # A server fitted from outside also pays for each idle spell in the step after it.
        self._wake = self.model.wake_times.get(self.hardware.name, ()) \
            if self.timing == "fit" else ()
        self._free_at = 0.0  # when the last step ended, in modelled time
        self.measured = Measured.of(self.model, self.hardware) \
            if self.timing == "measured" else None
        self._kv_format = self.model.kv_dtype
        self.buckets = parse_buckets(config.graph_buckets)
        self._kv_bytes_per_token = self.model.kv_bytes_per_token()
        self._fitted_kv_bytes_per_token = self._kv_bytes_per_token
        """KV bytes per token the fitted timing was measured with (the profile's kv_dtype)."""
        self.weight_formats = {g: "dense" for g in GROUPS}
        self.weight_bytes = self.model.matrix_weight_bytes
        """Matrix bytes every step reads in the current weight formats."""
        self._rid_hash: dict[str, int] = {}
        self.num_steps = 0
        hw = self.hardware
        link = hw.link_bandwidth_bytes_per_s or hw.bandwidth_bytes_per_s
        self.info = ExecutorInfo(
            "sim", f"sim:{self.model.name}@{hw.name}"
            + (f" {self.layout.name}" if self.layout.cards > 1 else ""), None, config.vocab_size,
            self.model.context_length, (config.eos_token_id,), self.model.num_layers,
            tuple(KV_FORMATS), link, f"{link / 1e9:,.0f} GB/s (profile)",
            virtual_time=True, computes_logits=False, device="none",
            draft_model_name=(f"modelled, {config.draft_cost:g}× target, {config.drafting}"
                              if config.draft_cost else ""))
        """Every KV format (the sim only accounts bytes); the host link is the hardware
        profile's."""
        self.block_size = 16
        self.offload_layers = 0
        self.offload_buffers = 2
        self._acceptance = config.acceptance_profile()
        self.slots = ServerSlots.of_profile(config.server_slots, self.model, hw.name,
                                            config.server_cache_ram_mib) \
            if config.server_slots else None

    def _resolve_timing(self) -> str:
        """The step model: `auto` is measured where the profile has measured steps on the
        card and no fitted-model value is overridden, else the fit where there is one (or
        values are given), else the roofline — as the planner chooses."""
        c = self.config
        has_measured = bool(self.model.decode_times.get(self.hardware.name))
        if c.timing == "measured" and not has_measured:
            raise ConfigError(f"Model profile {self.model.name} has no measured decode steps "
                              f"on {self.hardware.name}; use timing = 'fit' or 'roofline'.")
        if c.timing != "auto":
            return c.timing
        if self.layout.cards > 1:
            return "roofline"  # measured curves and fits are one card's
        overridden = (c.fixed_ms, c.per_token_us, c.per_pair_ns) != (None, None, None)
        if has_measured and not overridden:
            return "measured"
        return "fit" if overridden or self.hardware.name in self.model.fits else "roofline"

    def _resolve_fit(self) -> StepFit:
        c = self.config
        base = self.model.fits.get(self.hardware.name)
        values = (c.fixed_ms, c.per_token_us, c.per_pair_ns)
        if base is None and None in values and self.timing == "fit":
            raise ConfigError(
                f"Model profile {self.model.name} has no fitted timing for {self.hardware.name}; "
                "set fixed_ms, per_token_us and per_pair_ns, or use timing = 'roofline'."
            )
        base = base or StepFit(0.0, 0.0, 0.0)
        # Overrides replace their terms; the profile's per-sample and overhead terms stay.
        return dataclasses.replace(
            base,
            fixed_s=base.fixed_s if c.fixed_ms is None else c.fixed_ms / 1e3,
            per_token_s=base.per_token_s if c.per_token_us is None else c.per_token_us / 1e6,
            per_pair_s=base.per_pair_s if c.per_pair_ns is None else c.per_pair_ns / 1e9,
        )

    @property
    def holds(self) -> bool:
        """Behind llama-server's slots, with the profile's saves (`launch_hold`)."""
        return self.slots is not None and self.slots.save_seconds is not None

    def launch_hold(self, waiting: Sequence[Request]) -> float:
        """Behind llama-server's slots with its saves timed, the saves a launch of one of
        `waiting` makes first (`ServerSlots.launch_hold`); else 0."""
        return self.slots.launch_hold(waiting) if self.slots is not None else 0.0

    @property
    def request_overhead_s(self) -> float:
        """A request's way through the server outside its steps, where the fit was made from
        outside (`StepFit.overhead_s`); 0 otherwise."""
        return self.fit.overhead_s if self.timing == "fit" else 0.0

    # -- protocol ---------------------------------------------------------------------------

    def kv_bytes_per_token(self, kv_format: str) -> int:
        return self.model.kv_bytes_per_token(kv_format)

    def bind_kv(self, num_blocks: int, block_size: int, kv_format: str,
                groups: LayerGroups | None = None) -> None:
        """`groups` is always None here (the sim is no `WindowGroups`)."""
        assert groups is None, "the sim has no layer groups"
        # Accounting only: nothing to allocate.
        self._kv_bytes_per_token = self.kv_bytes_per_token(kv_format)
        self._kv_format = kv_format
        self.block_size = block_size
        self._bind_prompt_cache(num_blocks, kv_format)

    def _bind_prompt_cache(self, num_blocks: int, kv_format: str) -> None:
        """Behind llama-server's slots: its prompt cache's states are KV in the bound
        format, and its token limit is the server's context (else the pool's tokens)."""
        if self.slots is not None:
            cache = self.slots.cache
            cache.state_bytes = functools.partial(self.model.kv_bytes, block_size=1,
                                                  kv_format=kv_format)
            cache.context_tokens = self.config.server_context_tokens \
                or num_blocks * self.block_size

    def convert_kv(self, kv_format: str, num_blocks: int, src: list[int], dst: list[int]
                   ) -> Conversion:
        """Priced, not performed: the used blocks are read in the old format and written
        in the new one at the card's memory bandwidth (`bytes / (bandwidth · MBU)`)."""
        tokens = len(src) * self.block_size
        read = tokens * self._kv_bytes_per_token
        self._kv_bytes_per_token = self.kv_bytes_per_token(kv_format)
        self._kv_format = kv_format
        self._bind_prompt_cache(num_blocks, kv_format)
        written = tokens * self._kv_bytes_per_token
        hw = self.hardware
        return Conversion((read + written) / (hw.bandwidth_bytes_per_s * hw.mbu), False,
                          read, written)

    def bind_host_kv(self, num_blocks: int) -> None:
        """Accounting only: host blocks hold no bytes here."""

    # -- weight offload (priced) ------------------------------------------------------------

    @property
    def ffn_layer_bytes(self) -> int:
        """FFN matrix bytes of one layer in the current format (the profile's group
        shares)."""
        return int(self.model.ffn_layer_bytes(self.weight_bytes))

    @property
    def offload_gain_bytes(self) -> int:
        n = self.offload_layers
        return n * self.ffn_layer_bytes - min(self.offload_buffers, n) * self.ffn_layer_bytes

    def set_offload(self, num_layers: int, num_buffers: int) -> Conversion:
        """Priced, not performed: moving the weights to the host (or back) crosses the link
        once."""
        if not 0 <= num_layers <= self.info.num_layers:
            raise ConfigError(f"offload_layers must be from 0 to {self.info.num_layers} (the "
                              f"model's layers), got {num_layers}.")
        moved = abs(num_layers - self.offload_layers) * self.ffn_layer_bytes
        before = self.weight_bytes - self.offload_gain_bytes
        self.offload_layers, self.offload_buffers = num_layers, num_buffers
        return Conversion(moved / self.info.link_bandwidth, False, before,
                          self.weight_bytes - self.offload_gain_bytes)

    def describe_offload(self) -> str:
        n = self.offload_layers
        if not n:
            return ""
        size = self.ffn_layer_bytes
        buffers = min(self.offload_buffers, n)
        return (f"layers {self.info.num_layers - n}–{self.info.num_layers - 1} FFN; "
                f"{n * size / 2**20:,.0f} MiB per step; "
                f"{buffers} buffer{'s' if buffers > 1 else ''} × {size / 2**20:,.0f} MiB")

    def _offload_timeline(self, compute: float, origin: float) -> tuple[float, list[Transfer]]:
        """The step's length with offloaded layers and each prefetch: layers take
        `compute / layers` each; a copy takes `bytes / link`; with one buffer it starts when
        its layer is reached, with two when the offloaded layer before starts (copies in
        sequence on one copy engine); a layer starts once its weights are in."""
        n, size = self.offload_layers, self.ffn_layer_bytes
        t_layer, t_copy = compute / self.info.num_layers, size / self.info.link_bandwidth
        first = self.info.num_layers - n
        two = self.offload_buffers > 1 and n > 1
        t, copy_end, out = 0.0, t_copy if two else 0.0, []
        copy_start = 0.0
        for i in range(self.info.num_layers):
            if i >= first:
                if not two:
                    copy_start, copy_end = t, t + t_copy
                stall = max(copy_end - t, 0.0)
                out.append(Transfer("weights", "h2d", f"layer {i} ffn", 0, size,
                                    origin + copy_start, t_copy, t_copy, min(stall, t_copy)))
                t = max(t, copy_end)
                if two and i + 1 < self.info.num_layers:
                    copy_start = max(t, copy_end)
                    copy_end = copy_start + t_copy
            t += t_layer
        return t, out

    def _price_transfers(self, copies: list) -> tuple[float, list[Transfer]]:
        """The plan's block copies, one after another before the forward pass."""
        per_block = self._kv_bytes_per_token * self.block_size
        t, out = 0.0, []
        for kind, direction, what, pairs in copies:
            nbytes = len(pairs) * per_block
            seconds = nbytes / self.info.link_bandwidth
            out.append(Transfer(kind, direction, what, len(pairs), nbytes, t, seconds,
                                seconds, seconds))
            t += seconds
        return t, out

    def estimate_step_seconds(self, num_new_tokens: int, num_pairs: int,
                              num_context_tokens: int, num_sampled: int = 0,
                              shape: str = "") -> float:
        """Priced with its padding under execution shapes (padding rows attend nothing and
        read no KV: they cost matmul rows). `num_sampled`: rows through the output head,
        which a fit with a per-sample term prices; `shape`: "mixed" (prompt tokens beside
        decode rows, which a fit with a mixed term prices), "prefill" (one prompt chunk
        alone, which the profile's measured prefill steps correct) or "decode" (one token
        for each row, which its measured decode steps correct). `execute` knows both;
        the scheduler's estimates, which do not, leave them out."""
        rows, history = num_new_tokens, num_context_tokens - num_new_tokens  # pads cache nothing
        num_new_tokens = padded_rows(num_new_tokens, self.buckets)
        if self.layout.cards > 1:
            return layout_step_seconds(self.model, self.hardware, self.layout,
                                       self.weight_bytes, self._kv_bytes_per_token,
                                       num_new_tokens, num_pairs, num_context_tokens)
        if self.measured is not None:
            return self.measured.seconds(self.model, self.hardware, self.weight_bytes,
                                         num_context_tokens * self._kv_bytes_per_token,
                                         self._kv_format, num_new_tokens, num_pairs)
        if self.timing == "fit":
            # The fit was measured with the profile's weight and KV formats; other formats
            # change the bytes each step reads, priced at the card's bandwidth.
            extra = (self.weight_bytes - self.model.matrix_weight_bytes
                     + num_context_tokens * (self._kv_bytes_per_token
                                             - self._fitted_kv_bytes_per_token))
            if shape == "prefill":
                factor = self._prefill_factor(num_new_tokens, history)
            elif shape == "decode":  # each row's positions before its token
                factor = ratio_at(self._decode_ratios, rows, history // rows)
            else:
                factor = 1.0
            return fitted_seconds(self.fit, self.hardware, extra, num_new_tokens, num_pairs,
                                  num_sampled, num_context_tokens, shape == "mixed", factor)
        return roofline_seconds(self.model, self.hardware, self.weight_bytes,
                                self._kv_bytes_per_token, num_new_tokens, num_pairs,
                                num_context_tokens)

    def resolve_weight_formats(self, text: str, current: dict[str, str] | None = None
                               ) -> dict[str, str]:
        """See `TorchExecutor.resolve_weight_formats`; the sim measures no kernels, so
        `measured` is the profile's own (dense) format."""
        formats = parse_weight_format(text, current or self.weight_formats)
        return {g: "dense" if f == "measured" else f for g, f in formats.items()}

    def auto_choice(self) -> str:
        """The sim runs no kernels: `auto` is priced as dense and chooses nothing."""
        return ""

    def describe_weights(self, kv_format: str) -> WeightsView:
        """The weight formats and the matrix bytes each step is priced with."""
        return WeightsView(format_weight_format(self.weight_formats), self.weight_bytes,
                           "priced by the bytes read (simulated)")

    def set_weight_formats(self, formats: dict[str, str]) -> Conversion:
        """Priced, not performed: matrices are re-packed from a host master copy, so the
        pause is the new bytes written over the host link. Groups are weighed by the
        profile's group shares (from its GGUF or its `[weight_groups]`). `auto` and
        `measured` price as the profile's own format (the sim measures no kernels); kernel
        arithmetic differences are not modelled."""
        per = self.model.bytes_per_weight
        before = self.weight_bytes
        ratio = sum(share * PARAM_BYTES.get(formats[g], per) / per
                    for g, share in self.model.group_shares.items())
        self.weight_bytes = int(self.model.matrix_weight_bytes * ratio)
        self.weight_formats = dict(formats)
        hw = self.hardware
        link = hw.link_bandwidth_bytes_per_s or hw.bandwidth_bytes_per_s
        return Conversion(self.weight_bytes / link, False, before,
                          self.weight_bytes)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        self.num_steps += 1
        if self.num_steps == self.config.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.num_steps} (fail_at_step)")
        num_new = num_pairs = context = verify_rows = 0
        sampled: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        token = self._token
        draft_seconds = self._draft_seconds(plan) if self.info.draft_model_name else 0.0
        for chunk in plan.chunks:
            n, start = chunk.num_new_tokens, chunk.start
            num_new += n
            num_pairs += n * start + n * (n + 1) // 2  # causal_pairs, inlined: hot loop
            context += start + n
            if chunk.num_draft:
                spec[chunk.request.request_id] = self._verify(chunk)
                verify_rows += n  # verification scores every position
            elif chunk.sample:
                for req in (chunk.request, *chunk.branches):
                    tok = token(req.request_id, start + n)
                    if len(req.output_token_ids) < req.sampling.min_tokens and (
                            tok == self.config.eos_token_id
                            or tok in req.sampling.stop_token_ids):
                        # min_tokens masks EOS and the stop ids: the next non-ending token
                        tok = token(req.request_id, start + n, eos=False)
                        while tok in req.sampling.stop_token_ids:
                            tok = (tok + 1) % self.config.vocab_size
                    sampled[req.request_id] = tok
        # Rows through the output head, counted outside the hot loop: one per sampled token
        # and every verified position (the n > 1 samples of one prompt share its last row
        # but count one each: a few rows too many, at one step).
        # A measured prefill step is one prompt chunk alone: only such a step is corrected
        # by them (several chunks in one step are a shape no probe timed); a measured decode
        # step is one token for each row, no drafts.
        if plan.num_prefill_tokens:
            shape = "mixed" if plan.num_decode_tokens else \
                "prefill" if len(plan.chunks) == 1 else ""
        else:
            shape = "decode" if num_new == len(plan.chunks) else ""
        # Every request takes its slot when it is first scheduled, whatever the step.
        slots = [] if self.slots is None else [self.slots.slot(c.request) for c in plan.chunks]
        if not plan.chunks:
            seconds = 0.0
        elif self.slots is not None:
            seconds = self.slots.step_seconds(plan.chunks, slots, self.estimate_step_seconds)
        elif shape == "mixed" and self.config.prompt_pass:
            seconds = pass_seconds(plan.chunks, self.estimate_step_seconds)
        else:
            seconds = self.estimate_step_seconds(num_new, num_pairs, context,
                                                 len(sampled) + verify_rows, shape)
        transfers: list[Transfer] = []
        if plan.transfers:
            copy_seconds, transfers = self._price_transfers(plan.transfers)
        else:
            copy_seconds = 0.0
        if self.offload_layers and plan.chunks:
            seconds, weights = self._offload_timeline(seconds, copy_seconds)
            transfers.extend(weights)
        seconds += copy_seconds + draft_seconds
        if plan.chunks:
            seconds += wake_seconds(self._wake, plan.time - self._free_at)
            self._free_at = plan.time + seconds
        timing = StepTiming(
            seconds=seconds, measured=False,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_pairs=num_pairs,
            bytes_read=self.weight_bytes + context * self._kv_bytes_per_token,
            padded_rows=padded_rows(num_new, self.buckets) - num_new,
        )
        return StepResult(sampled, timing, transfers=transfers, draft_seconds=draft_seconds,
                          spec=spec)

    def propose(self, req, k: int, knobs) -> list[int]:
        """Modelled drafts: always `k` tokens (their values do not matter here; acceptance
        follows the acceptance profile in `execute`)."""
        return [0] * k

    def draft_kv_bytes_per_token(self, kv_format: str) -> int:
        """The modelled draft's twin KV per token (`draft_kv_ratio` of the target's)."""
        if not self.info.draft_model_name:
            return 0
        return round(self.config.draft_kv_ratio * self.model.kv_bytes_per_token(kv_format))

    def estimate_draft_seconds(self, num_rows: int) -> float:
        """One modelled draft pass over `num_rows` short rows."""
        return self.config.draft_cost * self.estimate_step_seconds(num_rows, num_rows, num_rows)

    def _draft_seconds(self, plan: SchedulerOutput) -> float:
        """The modelled draft model's time in this step (`sim_draft.draft_seconds`)."""
        return draft_seconds(plan, self.estimate_step_seconds, self.config.draft_cost,
                             self.config.drafting)

    def _verify(self, chunk) -> list[int]:
        """Accept each draft position with its profile's probability (a hash of seed,
        request and position: deterministic), stop at the first rejection, and emit the
        tokens the request generates at those positions — the same tokens as without
        speculation, as lossless verification must."""
        rid, start = chunk.request.request_id, chunk.start
        profile = self._acceptance
        accepted = 0
        for i in range(chunk.num_draft):
            u = splitmix64((self.seed << 40) ^ zlib.crc32(rid.encode()) ^ ((start + i) << 8))
            if (u >> 11) / float(1 << 53) >= profile[min(i, len(profile) - 1)]:
                break
            accepted += 1
        return [self._token(rid, start + 1 + j) for j in range(accepted + 1)]

    def _token(self, request_id: str, position: int, eos: bool = True) -> int:
        """The token a request generates at `position` (end-of-sequence by the config's
        chance unless `eos` is False)."""
        h = self._rid_hash.get(request_id)
        if h is None:
            # crc32, not hash(): Python's string hash changes between processes.
            h = self._rid_hash[request_id] = splitmix64(
                (self.seed << 32) ^ zlib.crc32(request_id.encode()))
        # One multiply-xorshift round of a per-request key (itself from splitmix64): cheap,
        # and the shift folds the well-mixed high bits into the low ones used for EOS.
        r = ((h + position) * 0x9E3779B97F4A7C15) & _MASK
        r ^= r >> 29
        c = self.config
        # Low 32 bits decide end-of-sequence, high 32 bits pick the token.
        if eos and c.eos_probability and (r & 0xFFFFFFFF) < c.eos_probability * 4294967296.0:
            return c.eos_token_id
        text = self.text_tokens
        if text:
            return text[(h + position) % len(text)]
        token = (r >> 32) % c.vocab_size
        return token if token != c.eos_token_id else (token + 1) % c.vocab_size

    def forget(self, request_id: str) -> None:
        """Drop per-request memo state once a request has finished."""
        self._rid_hash.pop(request_id, None)
        if self.slots is not None:
            self.slots.release(request_id)

    def close(self) -> None:
        self._rid_hash.clear()
