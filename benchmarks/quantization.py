"""Weight and KV formats on the torch executor: speed, the trade-offs behind it, and quality.

Model: Gemma 3 270M (the embedded default), fp32 compute, on this machine's threads.
Printed side by side, from one run:

1. The machine's kernel support (CPU capability, bf16/VNNI/AMX flags) and the start-up
   micro-benchmark of each weight format per layer group (`runtime/models/kernels.py`).
2. Weight formats (fp32 dense = the baseline, without the int8 shortlist the executor uses
   for greedy decoding over an fp32 head; bf16, int8 and int4 weight-only, auto): decode
   step time and output tokens/s at batch 1, 4, 8, 16 and 32 (requests of 32 distinct
   prompt tokens, 16 greedy output tokens each, only pure-decode steps timed), the ratio to
   fp32, and the batch at which each format is overtaken by another (the crossover).
3. KV formats (fp32 = the baseline, fp16, bf16, fp8_e4m3, q8_0, q4_0): one decode step's
   attention over 18 layers at contexts 512, 2K and 8K for 4 requests, timed; the bytes its
   reads save against fp32 (ΔD), the time spent decoding the stored values back to fp32
   (T_conv, timed alone), and the net gain the relation predicts, ΔT = ΔD/β − T_conv
   (β: this machine's read bandwidth, measured), next to the measured difference.
4. Quality against fp32 weights with fp32 KV (`runtime/text/quality.py`): teacher-forced top-1
   agreement and mean |Δlogit| over a fixed text, and identical greedy tokens on three
   fixed prompts; for int8 with fp32 activations as well as with the fast kernel's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.executors.kv_codecs import get_codec, kv_formats_for
from kvdeck.runtime.executors.paged_kv import PagedKVCache
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.kv.formats import KV_FORMATS
from kvdeck.runtime.models.kernels import cpuinfo, describe
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.models.weight_formats import GROUPS
from kvdeck.runtime.planning.machine import measure_machine
from kvdeck.runtime.text.quality import measure_formats
from kvdeck.runtime.text.tokenizer import Tokenizer

BATCHES = (1, 4, 8, 16, 32)
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "auto")
KV_CONTEXTS = (512, 2048, 8192)
PROMPT, OUTPUT = 32, 16


def cpu_flags() -> str:
    """The CPU flags that decide which low-precision kernels are fast."""
    flags = set((cpuinfo("flags") or "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16",
              "amx_int8", "avx512_fp16")
    return " ".join(f for f in wanted if f in flags) or "none of " + " ".join(wanted)


def decode_speed(ex: TorchExecutor, batch: int, fmt: str) -> tuple[float, float]:
    """(mean pure-decode step seconds, output tokens/s) at `batch` concurrent requests with
    weight format `fmt` for every group."""
    e = Engine(EngineConfig(kv_memory_bytes=256 << 20, knobs=Knobs(
        max_num_seqs=batch, max_num_batched_tokens=4096, chunk_size=4096,
        enable_prefix_caching=False, kv_format="fp32", weight_format=fmt)), ex)
    records: list[StepRecord] = []
    e.recorder = records.append
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
    for i in range(batch):
        e.add_request([2] + [(1000 + 37 * i + 11 * j) % 200_000 + 10
                             for j in range(PROMPT - 1)], sp)
    e.run_until_idle()
    e.check_integrity()
    steps = [r.dt for r in records if r.plan and len(r.plan) == batch
             and all(p.num_new_tokens == 1 for p in r.plan)]
    dt = sum(steps) / len(steps)
    return dt, batch / dt


def crossovers(speeds: dict[str, dict[int, float]]) -> list[str]:
    """For each pair of formats, the batch at which the slower-at-batch-1 one overtakes."""
    out = []
    names = list(speeds)
    for a in names:
        for b in names:
            if a >= b:
                continue
            lo, hi = (a, b) if speeds[a][1] >= speeds[b][1] else (b, a)
            cross = next((n for n in BATCHES if speeds[hi][n] > speeds[lo][n]), None)
            if cross is not None:
                out.append(f"{hi} overtakes {lo} at batch {cross}")
    return out


def weight_formats(ex: TorchExecutor) -> dict:
    speeds: dict[str, dict[int, float]] = {}
    steps: dict[str, dict[int, float]] = {}
    for fmt in WEIGHT_FORMATS:
        conv = ex.set_weight_formats({g: fmt for g in GROUPS})
        speeds[fmt], steps[fmt] = {}, {}
        for b in BATCHES:
            steps[fmt][b], speeds[fmt][b] = decode_speed(ex, b, fmt)
        print(f"  {fmt:>5} (packed in {conv.seconds:5.2f} s, weights "
              f"{ex.resident_weight_bytes / 2**20:6.0f} MiB): " + "  ".join(
                  f"b{b} {steps[fmt][b] * 1e3:6.1f} ms {speeds[fmt][b]:6.1f} tok/s "
                  f"({speeds[fmt][b] / speeds['fp32'][b]:.2f}x)" for b in BATCHES))
    ex.set_weight_formats({g: "dense" for g in GROUPS})
    cross = crossovers(speeds)
    for line in cross:
        print(f"  crossover: {line}")
    best = max((f for f in WEIGHT_FORMATS if f not in ("fp32", "bf16", "auto")),
               key=lambda f: speeds[f][1])
    print(f"  batch 1: best weight-only format {best} = "
          f"{speeds[best][1] / speeds['fp32'][1]:.2f}x fp32 weights")
    return {"tokens_per_s": speeds, "step_s": steps, "crossovers": cross,
            "best_weight_only_batch1": [best, speeds[best][1] / speeds["fp32"][1]]}


@torch.inference_mode()
def kv_tradeoff(ex: TorchExecutor, bandwidth: float, rows: int = 4, reps: int = 3) -> list:
    info = ex.cfg.info
    layers, kvh, d = info.num_layers, info.num_kv_heads, info.head_dim
    block = 16
    q = torch.randn(rows, info.num_heads, 1, d)
    out = []
    for ctx in KV_CONTEXTS:
        nb = ctx // block
        base = None
        for name in ("fp32", *[f for f in kv_formats_for(d, ex.device) if f != "fp32"]):
            codec = get_codec(name, d, ex.device)
            pool = PagedKVCache(1, rows * nb, block, kvh, d, codec, ex.device)
            values = torch.randn(rows * nb * block, kvh, d)
            pool.write(0, torch.arange(rows * nb * block), values, values)
            tables = torch.arange(rows * nb).view(rows, nb)

            t_step = layers * best_of(lambda p=pool, t=tables: attend_once(p, t, q), reps)
            t_conv = layers * best_of(lambda p=pool, c=codec, n=rows * ctx: decode_all(p, c, n),
                                      reps) if name != "fp32" else 0.0
            saved = rows * ctx * (info.kv_bytes_per_token("fp32") -
                                  info.kv_bytes_per_token(name))
            if base is None:
                base = t_step
            predicted = saved / bandwidth - t_conv
            row = {"context": ctx, "format": name, "attention_ms": t_step * 1e3,
                   "bytes_saved": saved, "conversion_ms": t_conv * 1e3,
                   "predicted_gain_ms": predicted * 1e3,
                   "measured_gain_ms": (base - t_step) * 1e3}
            out.append(row)
            print(f"  ctx {ctx:>5} {name:>8}: attention {t_step * 1e3:7.2f} ms, ΔD "
                  f"{saved / 2**20:7.1f} MiB, T_conv {t_conv * 1e3:6.2f} ms → predicted "
                  f"ΔT {predicted * 1e3:+7.2f} ms, measured {(base - t_step) * 1e3:+7.2f} ms")
    return out


def attend_once(pool: PagedKVCache, tables: torch.Tensor, q: torch.Tensor) -> None:
    """One layer of decode attention: gather (and decode) the context, then attend."""
    k, v = pool.gather(0, tables, torch.float32)
    F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale=1.0,
                                   enable_gqa=True)


def decode_all(pool: PagedKVCache, codec, n: int) -> None:
    """The conversion alone: decode `n` stored tokens' K and V of one layer to fp32."""
    for stored in (pool.k[0], pool.v[0]):
        codec.decode([t.view(-1, *t.shape[2:])[:n] for t in stored], torch.float32)


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def quality(path: Path, tok: Tokenizer, threads: int) -> list:
    rows = []
    for act in ("measured", "fp32"):
        ex = TorchExecutor(path, device="cpu", dtype="fp32", threads=threads,
                           weight_activations=act)
        label = f"activations {ex.packer.activations_for('int8')}"
        weights = ("bf16", "int8", "int4") if act == "measured" else ("int8",)
        kv = tuple(f for f in kv_formats_for(ex.cfg.info.head_dim, ex.device)
                   if f != "fp32") if act == "measured" else ()
        for q in measure_formats(ex, tok, weights, kv):
            where = ", ".join(f"pos {p} margin {m:.3f}" for p, m in q.disagreements[:4])
            print(f"  {q.line()} [{label if q.label.startswith('weights int') else ''}]"
                  + (f"; first disagreements: {where}" if where else ""))
            rows.append({"label": q.label, "activations": label,
                         "top1": q.top1_agreement, "mean_abs_dlogit": q.mean_abs_dlogit,
                         "identical_greedy": q.identical_greedy})
        ex.close()
    return rows


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    path = resolve_model(DEFAULT_MODEL)
    threads = torch.get_num_threads()
    tok = Tokenizer(path)
    bandwidth, _ = measure_machine()
    # fp32 weights without the int8 shortlist for greedy decoding (`greedy_tokens`): the
    # baseline is the dense fp32 head, as every format is measured on its own weights.
    ex = TorchExecutor(path, device="cpu", dtype="fp32", threads=threads,
                       greedy_shortlist=False)
    print(f"model {path.name}; {threads} threads; torch {torch.__version__}; CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; flags: {cpu_flags()}; read "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s")
    k = ex.packer.kernels
    print(f"kernel micro-benchmark ({'cached' if k.cached else f'{k.seconds_spent:.1f} s'}; "
          f"int8 activations {ex.packer.activations_for('int8')}, int4 "
          f"{ex.packer.activations_for('int4')}; measured default "
          f"{ex.resolve_weight_formats('measured')}):")
    for line in describe(k):
        print(f"  {line}")
    print(f"weight formats: {PROMPT} prompt + {OUTPUT} output tokens per request, greedy")
    weights = weight_formats(ex)
    print(f"KV formats: one decode step's attention for 4 requests, {ex.cfg.info.num_layers} "
          "layers, against fp32 storage")
    kv = kv_tradeoff(ex, bandwidth)
    ex.close()
    print("quality against fp32 weights + fp32 KV:")
    qual = quality(path, tok, threads)
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "quantization", "model": path.name, "threads": threads,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "cpu_flags": cpu_flags(), "read_bandwidth_bytes_per_s": bandwidth,
              "kernels": k.times, "weights": weights, "kv": kv, "quality": qual,
              "kv_formats": list(KV_FORMATS)}
    (out_dir / "quantization.json").write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench-results"))
