"""The step-time model behind the sim executor and the planner, in one place so that the two
agree by construction (docs/architecture.md, "Step time").

- **Measured** (where a model profile has measured decode steps on the card,
  `[decode.<hardware>]`, as the reference card's table or `kvdeck calibrate` writes them):
  a step costs `max(curve(D), F / (P·MFU_prefill), D / β)`. `curve` interpolates the
  measured steps in the bytes each one read (`D = D_w + b·L·k` of its batch and context), so
  a step is priced by the bytes *it* reads along the card's own curve — the way the source
  chapter prices its schemes: with CUDA graphs off a decode step is nearly a fixed cost,
  and one more GB read adds what the measured points say (0.15 ms on the reference card),
  not `1 GB / (β·MBU)`. `F` counts the matmuls of the new tokens (the output head only on
  sampled rows, which the decode curve already holds) and attention over the causal pairs.
  A KV format other than the measured one changes `D`, plus its measured conversion cost
  per byte read where the profile has one (`Measured.convert_known`).
- **Roofline:** `max(F / (P·MFU), D / (β·MBU))`, with `F = 2·matrix_params·n_new +
  4·pairs·heads·head_dim·layers` (matmuls, then attention's QKᵀ and PV over the causal
  query–key pairs) and `D = D_w + context·k` (weights once, the batch's KV once).
- **Fitted:** `fixed + per_token·n_new + per_pair·pairs [+ per_sample·rows sampled +
  per_context·positions read]`, measured with the profile's own
  weight and KV formats; other formats change the bytes a step reads, priced at the card's
  bandwidth (`extra / (β·MBU)`, never below a tenth of the fitted time). Used where no
  measured steps exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile, StepFit


def parse_buckets(text: str) -> tuple[int, ...]:
    """Execution shapes (CUDA-graph batch sizes) as an ascending tuple: comma-separated
    row counts from 1 to 65,536, each once; an empty text is none."""
    if not text.strip():
        return ()
    try:
        buckets = tuple(sorted(int(x) for x in text.split(",")))
    except ValueError:
        buckets = (0,)
    if any(not 1 <= b <= 65_536 for b in buckets) or len(set(buckets)) != len(buckets):
        raise ConfigError(f"graph_buckets must be comma-separated row counts from 1 to 65536, "
                          f"each once, like 1,2,4,8,16,32; got {text!r}.")
    return buckets


def padded_rows(num_new: int, buckets: tuple[int, ...]) -> int:
    """The rows a step runs with execution shapes: the smallest bucket that holds its
    `num_new` rows (the rest is padding), or the rows themselves past the largest bucket
    or without buckets (run eagerly, no graph)."""
    if not buckets or num_new > buckets[-1]:
        return num_new
    return next(b for b in buckets if b >= num_new)


def graph_pool_bytes(model: ModelProfile, rows: int, positions: int, act_bytes: int = 2
                     ) -> int:
    """The memory CUDA graphs keep for replay, as the torch executor captures them
    (`executors/torch_graphs.py`): one pool shared by every graph, as large as the live
    tensors of the largest step captured, which peak in attention. Per row: the residual
    stream, the query and the attention output (`3·heads·d` activations, the residual's
    width taken as the query's), one layer's keys and values gathered along the row's
    table (`2·kv_heads·d·positions`, same dtype) and the scores with their softmax
    (`2·heads·positions` in fp32). Checked against the pool the torch executor measured on
    an NVIDIA H200 (Gemma 3 270M's shape, 64 rows at 96 positions, bf16): 6.6 MiB by this,
    6.7 MiB measured. Attention kernels that read the pool in place (vLLM's) hold less."""
    h, d, kvh = model.num_heads, model.head_dim, model.num_kv_heads
    per_row = act_bytes * (3 * h * d + 2 * kvh * d * positions) + 4 * 2 * h * positions
    return rows * per_row


def graph_reserve(model: ModelProfile, buckets: tuple[int, ...], positions: int) -> int:
    """What graphs at `buckets` keep out of the KV budget: the pool of the largest bucket at
    `positions` (a request's longest context), 0 without buckets."""
    return graph_pool_bytes(model, buckets[-1], positions) if buckets else 0


def attention_flops(model: ModelProfile, num_pairs: float) -> float:
    """QKᵀ and PV over `num_pairs` causal query–key pairs, every head and layer."""
    return 4.0 * num_pairs * model.num_heads * model.head_dim * model.num_layers


def roofline_seconds(model: ModelProfile, hw: HardwareProfile, weight_bytes: float,
                     kv_bytes_per_token: float, num_new: int, num_pairs: int,
                     num_context: int) -> float:
    """One step by the roofline: `num_new` new tokens, `num_pairs` causal pairs and
    `num_context` KV positions read, with `weight_bytes` of matrices read once."""
    flops = 2.0 * model.matrix_params * num_new + attention_flops(model, num_pairs)
    bytes_read = weight_bytes + num_context * kv_bytes_per_token
    return max(flops / (hw.peak_flops * hw.mfu), bytes_read / (hw.bandwidth_bytes_per_s * hw.mbu))


def fitted_seconds(fit: StepFit, hw: HardwareProfile, extra_bytes: float, num_new: float,
                   num_pairs: float, num_sampled: float = 0.0, num_context: float = 0.0,
                   mixed: bool = False, factor: float = 1.0) -> float:
    """One step by the fitted model, plus `extra_bytes` read beyond what the fit measured
    (negative when a smaller format reads less); `num_sampled` rows and `num_context` KV
    positions read priced by the fit's per-sample and per-context terms where it has them,
    a step that carries prompt tokens beside decode rows (`mixed`) by its mixed term, and
    the fit scaled by `factor` (the measured steps' correction near this one:
    `ModelProfile.prefill_factor`)."""
    seconds = fit.seconds(num_new, num_pairs, num_sampled, num_context, mixed) * factor
    return max(seconds + extra_bytes / (hw.bandwidth_bytes_per_s * hw.mbu), seconds * 0.1)


@dataclass(frozen=True)
class Measured:
    """A card's measured decode steps as a curve in the bytes a step reads, with the
    measured prefill efficiency and KV conversion costs (`ModelProfile`'s `[decode.<hw>]`)."""

    points: tuple[tuple[float, float], ...]
    """(bytes read, seconds), ascending in both; steps that read the same bytes averaged."""
    prefill_mfu: float
    convert_s_per_byte: dict[str, float]
    measured_format: str
    """The KV format the steps were measured with (the profile's `kv_dtype`)."""

    @classmethod
    def of(cls, model: ModelProfile, hw: HardwareProfile) -> Measured | None:
        """The curve of `model` on `hw`, or None when the profile has no measured steps
        there. Prefill efficiency: the profile's measured one, else the card's MFU."""
        steps = model.decode_times.get(hw.name)
        if not steps:
            return None
        k = model.kv_bytes_per_token()
        by_bytes: dict[float, list[float]] = {}
        for batch, context, seconds in steps:
            by_bytes.setdefault(model.matrix_weight_bytes + batch * context * k, []).append(
                seconds)
        points, most = [], 0.0
        for b, s in sorted(by_bytes.items()):
            # Non-decreasing: a step that reads more is never cheaper on the curve (a CPU's
            # wider batch at a shorter context reads less and yet takes longer).
            most = max(most, sum(s) / len(s))
            points.append((b, most))
        return cls(tuple(points), model.prefill_mfu.get(hw.name, hw.mfu),
                   model.kv_convert_s_per_byte.get(hw.name, {}), model.kv_dtype)

    def seconds_at(self, nbytes: float) -> float:
        """The step that reads `nbytes`, interpolated linearly between the measured points;
        past either end the nearest segment's slope carries on (never downward)."""
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        i = next((j for j in range(1, len(pts) - 1) if nbytes <= pts[j][0]), len(pts) - 1)
        (b0, s0), (b1, s1) = pts[i - 1], pts[i]
        slope = max((s1 - s0) / (b1 - b0), 0.0)
        return max(s0 + slope * (nbytes - b0), 0.0)

    def convert_known(self, kv_format: str) -> bool:
        """Whether a step in `kv_format` is fully priced: the measured format, or one whose
        conversion cost was measured on this card."""
        return kv_format == self.measured_format or kv_format in self.convert_s_per_byte

    def seconds(self, model: ModelProfile, hw: HardwareProfile, weight_bytes: float,
                kv_bytes: float, kv_format: str, num_new: float, num_pairs: float) -> float:
        """One step reading `weight_bytes` of matrices and `kv_bytes` of KV in `kv_format`,
        computing `num_new` new tokens over `num_pairs` causal pairs: the larger of the
        curve at the bytes it reads and its matmuls and attention at the measured prefill
        efficiency, never below the bandwidth floor; plus the format's measured conversion
        cost (none where unmeasured: `convert_known` says so)."""
        head = model.group_shares["head"] * model.matrix_params
        flops = 2.0 * (model.matrix_params - head) * num_new + attention_flops(model, num_pairs)
        read = weight_bytes + kv_bytes
        step = max(self.seconds_at(read), flops / (hw.peak_flops * self.prefill_mfu),
                   read / hw.bandwidth_bytes_per_s)
        return step + kv_bytes * self.convert_s_per_byte.get(kv_format, 0.0)
