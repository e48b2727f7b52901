"""A start-up micro-benchmark of the matrix kernels on this machine, for this model's shapes.

The same weight format can be the fastest or the slowest depending on the CPU and on the
activation dtype (on an AVX-512 machine with BF16 and VNNI, Gemma 3's 262,144 × 640 head at
batch 1: 56 ms fp32, 21 ms bf16, 12 ms int8 with bf16 activations, 71 ms int8 with fp32
activations; on an AVX2 machine bf16 is ~8× slower than fp32). So kvdeck measures instead of
guessing per device type: for one matrix of each layer group (`attn`: the Q projection,
`ffn`: the up projection, `head`: the output head) and each (weight format, activation
dtype) pair, the time of one product at 1, 8 and 32 rows. From the table:

- each quantized format's activation dtype is the one fastest at one row;
- `measured` (the default weight format) is, per group, the fastest at one row of dense
  weights in the compute dtype, bf16 weights and int8 weight-only (within 15 %, the more
  accurate of them) — decode of one request
  is what an interactive user feels, and these keep accuracy close to fp32 (int4 is
  offered, never chosen for the user);
- `auto` switches a group from int8 to dense at its crossover: the fewest rows at which
  dense is at least as fast;
- int8 runs its packed kernel below, and its gemm kernel from, the fewest rows at which
  gemm is timed at least as fast (`int8_gemm_from`; `linear.WeightOnlyInt8` says why both),
  and int8's time at a row count is that of the kernel it runs there.

Results are cached per machine, torch version, thread count, device and shapes in
`$KVDECK_CACHE/kernels/` (a JSON file), so only the first start pays (a few seconds). A
cached table is trusted only as far as the machine is as fast now as when it was measured:
every start times one reference product (a few milliseconds), and a table taken while
the reference ran `REMEASURE_FASTER` times slower than now — on a machine busy through the
measurement, or on another host under the same CPU name — is measured again: a table
taken under load misjudges which format is fastest (docs/benchmarks.md gives the case that
found it). The CPU's compute dtype, cached beside it, is checked the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvdeck.runtime.models.linear import pack_matrix

log = logging.getLogger("kvdeck.kernels")

ROWS = (1, 8, 32)
FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VERSION = 3
MAX_ROWS_TIMED = 32_768
INT8_GEMM = "int8.gemm"
"""The table's name for int8's gemm kernel (`int8` alone: the packed one)."""
NEVER = 1 << 62
"""`int8_gemm_from` where the packed kernel stays faster at any row count, or where the
two kernels were not timed apart."""


def candidates(device: torch.device) -> list[tuple[str, str]]:
    """(weight format, activation dtype) pairs worth timing on `device`; int8's two kernels
    apart where it has the packed one (`INT8_GEMM`: the gemm one)."""
    acts = ["fp32", "bf16"] + (["fp16"] if device.type != "cpu" else [])
    pairs = [(f, f) for f in acts]
    packed = device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
    int8 = ("int8", INT8_GEMM) if packed else ("int8",)
    pairs += [(q, a) for q in (*int8, "int4") for a in acts]
    return pairs


def _pack_timed(w: torch.Tensor, fmt: str, act: str, group_size: int,
                int8_group_size: int):
    """The matrix `measure` times for a (format, activation dtype) pair."""
    if fmt in FLOAT:
        return pack_matrix(w, None, "dense", FLOAT[act])
    if fmt == "int8":  # the packed kernel at every row count
        return pack_matrix(w, None, fmt, FLOAT[act], group_size, int8_group_size, NEVER)
    if fmt == INT8_GEMM:
        return pack_matrix(w, None, "int8", FLOAT[act], group_size, int8_group_size, 1)
    return pack_matrix(w, None, fmt, FLOAT[act], group_size, int8_group_size)


@dataclass
class KernelTable:
    """Seconds per product: `times[group][f"{format}/{act}"][str(rows)]` (None: skipped
    as hopeless after one row; taken then to grow in proportion to the rows, as the
    per-row kernels that are hopeless at one row do)."""

    times: dict[str, dict[str, dict[str, float | None]]]
    compute: str
    """The model's compute dtype (dense weights in it are the baseline)."""
    seconds_spent: float = 0.0
    cached: bool = False
    machine: dict[str, str] = field(default_factory=dict)
    reference_s: float = 0.0
    """The reference product's time while the table was measured: the faster of before
    and after (the measurement itself may slow the machine, by heat or clocks, and the
    slower would have every later start measure again); 0: a table from before
    references were kept."""
    _gemm_from: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """`int8_gemm_from`'s answers, kept: `times` does not change once a table is read."""

    def time(self, group: str, fmt: str, act: str, rows: int) -> float:
        """Seconds for `rows` rows (interpolated linearly between measured row counts); int8's
        are those of the kernel it runs at that row count."""
        if fmt == "int8" and f"{INT8_GEMM}/{act}" in self.times[group]:
            fmt = INT8_GEMM if rows >= self.int8_gemm_from(group, act) else fmt
        return self._time(group, fmt, act, rows)

    def int8_gemm_from(self, group: str, act: str, limit: int = 4096) -> int:
        """The fewest rows from which int8's gemm kernel runs: where it is timed at least
        as fast as the packed one, up to `limit` rows (`NEVER` past it, and where the two
        were not timed apart: no packed kernel here, whose matrices run gemm regardless,
        or an activation dtype the table has not timed, which keeps the packed kernel)."""
        if f"{INT8_GEMM}/{act}" not in self.times[group]:
            return NEVER
        key = (group, act, limit)
        if key not in self._gemm_from:  # asked per matrix packed and per time()
            self._gemm_from[key] = next(
                (rows for rows in range(1, limit + 1) if self._time(group, INT8_GEMM, act, rows)
                 <= self._time(group, "int8", act, rows)), NEVER)
        return self._gemm_from[key]

    def _time(self, group: str, fmt: str, act: str, rows: int) -> float:
        table = self.times[group].get(f"{fmt}/{act}")
        if table is None:
            return float("inf")
        pts = [(int(r), t) for r, t in table.items() if t is not None]
        if not pts:
            return float("inf")
        pts.sort()
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, t0), (r1, t1) in zip(pts, pts[1:], strict=False):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        if len(pts) > 1 and self._ran_gemm(group, fmt):
            # A fixed dequantization, then a product that grows with the rows: along the
            # last measured slope (never down), not in proportion (which would scale the
            # fixed part too).
            (r0, t0), (r1, t1) = pts[-2:]
            return t1 + max(t1 - t0, 0.0) * (rows - r1) / (r1 - r0)
        return pts[-1][1] * rows / pts[-1][0]

    def _ran_gemm(self, group: str, fmt: str) -> bool:
        """Whether `fmt`'s timings are of int8's gemm kernel: its own entry, or int8's
        where the packed kernel was missing (no `INT8_GEMM` entries then)."""
        return fmt == INT8_GEMM or fmt == "int8" and not any(
            key.startswith(INT8_GEMM + "/") for key in self.times[group])

    def best_act(self, fmt: str) -> str:
        """The activation dtype with which `fmt` is fastest at one row, over all groups."""
        if fmt in FLOAT:
            return fmt
        acts = {key.split("/")[1] for g in self.times.values() for key in g
                if key.startswith(fmt + "/")}
        return min(sorted(acts), key=lambda a: sum(self.time(g, fmt, a, 1) for g in self.times))

    def fastest(self, group: str, formats: tuple[str, ...], rows: int,
                act_for=None, within: float = 0.0) -> str:
        """The format fastest at `rows` rows; `act_for(format)` names the activation dtype
        used (default: each format's fastest). With `within`, the first of `formats` (list
        the more accurate first) whose time is within that fraction of the fastest wins:
        a few percent is measurement noise on a shared machine, not a reason to quantize."""
        act = act_for or self.best_act
        times = {f: self.time(group, f, f if f in FLOAT else act(f), rows) for f in formats}
        best = min(times.values())
        return next(f for f in formats if times[f] <= best * (1 + within))

    def measured_choice(self, act_for=None) -> dict[str, str]:
        """Per group, the fastest at one row of dense weights in the compute dtype, bf16
        weights and int8 (a tie goes to the earlier, more accurate one)."""
        candidates = tuple(dict.fromkeys((self.compute, "bf16", "int8")))
        return {g: self.fastest(g, candidates, 1, act_for, within=0.15) for g in self.times}

    def crossover(self, group: str, low: str, high: str, limit: int = 256) -> int | None:
        """The fewest rows at which `high` is at least as fast as `low` (None: never up to
        `limit`, or `high` is faster from one row)."""
        a, b = self.best_act(low), self.best_act(high)
        if self.time(group, high, b, 1) <= self.time(group, low, a, 1):
            return None
        for rows in range(2, limit + 1):
            if self.time(group, high, b, rows) <= self.time(group, low, a, rows):
                return rows
        return None

    def to_json(self) -> dict:
        return {"version": VERSION, "times": self.times, "compute": self.compute,
                "seconds_spent": self.seconds_spent, "machine": self.machine,
                "reference_s": self.reference_s}


def cpuinfo(field: str) -> str | None:
    """The first `field` line of /proc/cpuinfo (None where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith(field)), None)


def _machine(device: torch.device) -> dict[str, str]:
    cpu = cpuinfo("model name") or platform.processor() or platform.machine()
    info = {"cpu": cpu, "torch": torch.__version__, "threads": str(torch.get_num_threads()),
            "device": device.type,
            "capability": str(torch.backends.cpu.get_cpu_capability())}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _time_once(fn, x: torch.Tensor, device: torch.device, reps: int,
               budget_s: float = 0.5) -> float:
    """The best of `reps` timed calls after a warm-up; fewer once they took `budget_s`
    (a slow product varies little between calls, and a start-up should not wait on it)."""
    fn(x)  # warm-up: packing caches, allocator
    best, spent = float("inf"), 0.0
    for _ in range(reps):
        if spent > budget_s:
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
    return best


@torch.inference_mode()
def measure(shapes: dict[str, tuple[int, int]], device: torch.device, compute: str,
            group_size: int = 32, int8_group_size: int = 0, reps: int = 3) -> KernelTable:
    """Time every candidate pair on random weights of each group's shape (out, in)."""
    t_start = time.perf_counter()
    reference = reference_seconds(device)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, dict[str, dict[str, float | None]]] = {}
    for group, (n_full, k) in shapes.items():
        # A tall matrix (an output head) is timed on a slice of its rows and scaled: its
        # products are bound by the bytes read, which grow with the rows; packing the
        # whole 168M-weight head in every format would cost more than the measurement.
        n = min(n_full, MAX_ROWS_TIMED)
        scale = n_full / n
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device)
        times[group] = {}
        best_one = float("inf")
        for fmt, act in candidates(device):
            try:
                m = _pack_timed(w, fmt, act, group_size, int8_group_size)
            except (RuntimeError, ValueError):  # no kernel for this pair here
                continue
            row: dict[str, float | None] = {}
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen).to(device=device, dtype=FLOAT[compute])
                # int8's gemm kernel pays a fixed dequantization at one row and is for
                # more rows: it is always timed at all of them.
                first = row[str(ROWS[0])] if rows > 1 else None
                if fmt != INT8_GEMM and first is not None and first > 4 * best_one:
                    row[str(rows)] = None  # hopeless at one row: not worth the time
                    continue
                try:
                    row[str(rows)] = _time_once(m, x, device, reps) * scale
                except RuntimeError:
                    row[str(rows)] = None
            if row.get("1") is not None:
                best_one = min(best_one, row["1"])
            times[group][f"{fmt}/{act}"] = row
            del m
    reference = min(reference, reference_seconds(device))
    return KernelTable(times, compute, time.perf_counter() - t_start, False, _machine(device),
                       reference)


REMEASURE_FASTER = 1.5
"""A cached table is measured again when the reference product now runs this many times
faster than while the table was measured. Slower now leaves it: this start is the busy
one, and the table was taken in better conditions."""


def _reference_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The reference product's matrix (`CPU_DTYPE_SHAPE`, fp32) and its 8 rows."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(*CPU_DTYPE_SHAPE, generator=gen) * 0.02,
            torch.randn(8, CPU_DTYPE_SHAPE[1], generator=gen))


@torch.inference_mode()
def reference_seconds(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """How fast the machine is at this moment: the reference product, best of 20 (in
    fp32; `cpu_compute_dtype` times it in bf16 too)."""
    w, x = (t.to(device=device, dtype=dtype) for t in _reference_inputs())
    return _time_once(lambda a: torch.nn.functional.linear(a, w), x, device, 20)


def stale(cached_reference_s: float, now_s: float) -> bool:
    """Whether a table whose reference took `cached_reference_s` is measured again, the
    reference taking `now_s` now: where it has none, or the machine is clearly faster now."""
    return cached_reference_s <= 0 or now_s * REMEASURE_FASTER < cached_reference_s


def load_or_measure(shapes: dict[str, tuple[int, int]], device: torch.device, compute: str,
                    cache_dir: Path | None, group_size: int = 32,
                    int8_group_size: int = 0) -> KernelTable:
    """The cached table for this machine and these shapes, or a fresh measurement (saved)."""
    machine = _machine(device)
    key = json.dumps({"machine": machine, "shapes": shapes, "compute": compute,
                      "group_size": group_size, "int8_group_size": int8_group_size,
                      "version": VERSION}, sort_keys=True)
    path = None
    if cache_dir is not None:
        path = cache_dir / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
        try:
            d = json.loads(path.read_text())
            if d.get("version") == VERSION:
                cached = KernelTable(d["times"], d["compute"], d.get("seconds_spent", 0.0),
                                     True, d.get("machine", {}),
                                     float(d.get("reference_s") or 0.0))
                now = reference_seconds(device)
                if not stale(cached.reference_s, now):
                    return cached
                log.info("the kernel table at %s %s: measuring again", path,
                         f"was measured with the reference product at "
                         f"{cached.reference_s * 1e3:.3f} ms, {now * 1e3:.3f} ms now"
                         if cached.reference_s else "has no reference time")
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no cache yet, or an unreadable one: measure again
    table = measure(shapes, device, compute, group_size, int8_group_size)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table.to_json(), indent=1))
        except OSError as e:
            log.warning("could not cache the kernel table at %s: %s", path, e)
    return table


CPU_DTYPE_SHAPE = (2048, 640)
"""The matrix the CPU's compute dtype is timed on: Gemma 3 270M's FFN up-projection, a
typical small model's; at 8 rows, a batched decode step."""
CPU_DTYPE_GAIN = 1.3
"""bf16 is chosen only when it is at least this much faster than fp32: it costs accuracy
(on Gemma 3 270M fp32 and bf16 weights agree on most but not all top-1 tokens)."""


@torch.inference_mode()
def cpu_compute_dtype(cache_dir: Path | None) -> str:
    """`bf16` where this CPU multiplies bf16 matrices clearly faster than fp32 (AMX or
    AVX-512 BF16 kernels in torch's oneDNN), else `fp32`: timed once on this machine and
    kept in `cache_dir`, never decided from the CPU's name."""
    device = torch.device("cpu")
    machine = _machine(device)
    key = hashlib.sha1(json.dumps({"machine": machine, "shape": CPU_DTYPE_SHAPE,
                                   "version": VERSION}, sort_keys=True).encode()).hexdigest()
    path = cache_dir / f"cpu-dtype-{key[:16]}.json" if cache_dir is not None else None
    now = reference_seconds(device)
    if path is not None:
        try:
            d = json.loads(path.read_text())
            # Its fp32 time is the reference product's: timed again where the machine is
            # clearly faster now (the choice was made on a busy machine).
            if not stale(float(d["seconds"]["fp32"]), now):
                return d["dtype"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    seconds = {"fp32": now, "bf16": reference_seconds(device, torch.bfloat16)}
    dtype = "bf16" if seconds["fp32"] >= CPU_DTYPE_GAIN * seconds["bf16"] else "fp32"
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"dtype": dtype, "seconds": seconds,
                                        "machine": machine}, indent=1))
        except OSError as e:
            log.warning("could not cache the CPU dtype choice at %s: %s", path, e)
    return dtype


def describe(table: KernelTable, rows: tuple[int, ...] = (1, 8, 32)) -> list[str]:
    """Lines for a log or the console: per group, each format's best time at some rows."""
    out = []
    for group in table.times:
        parts = []
        for fmt in ("fp32", "bf16", "fp16", "int8", "int4"):
            act = table.best_act(fmt)
            t = [table.time(group, fmt, act, r) for r in rows]
            if all(x == float("inf") for x in t):
                continue
            label = fmt if fmt in FLOAT else f"{fmt}({act})"
            if fmt == "int8" and f"{INT8_GEMM}/{act}" in table.times[group]:
                rows_from = table.int8_gemm_from(group, act)
                kernel = "gemm" if rows_from == 1 else "packed" if rows_from == NEVER else \
                    f"gemm from {rows_from} rows"
                label = f"int8({act}, {kernel})"
            parts.append(f"{label} " + "/".join(f"{x * 1e3:.2f}" for x in t))
        out.append(f"{group} ms at {'/'.join(map(str, rows))} rows: " + ", ".join(parts))
    return out
