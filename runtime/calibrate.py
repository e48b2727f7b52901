"""`kvdeck calibrate`: measure a real executor and fit the sim executor's step-time model.

The sweep times prefill chunks of `c` tokens on `h` cached ones and decode steps of `b`
requests at context `L`, through the real engine and KV manager. A least-squares fit of
`seconds = fixed + per_token × new_tokens + per_pair × causal_pairs` (coefficients kept
non-negative) is written as a model profile plus a hardware profile for this machine, in
the user profiles directory, where the sim executor finds them by name.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from runtime.config import EngineConfig, Knobs
from runtime.engine import Engine
from runtime.executors.torch import TorchExecutor
from runtime.plan import causal_pairs
from runtime.profiles import StepFit, user_profiles_dir
from runtime.request import SamplingParams

FULL_SWEEP = {"prefill": [(c, h) for c in (16, 64, 256) for h in (0, 256, 1024)],
              "decode": [(b, ctx) for b in (1, 4, 16) for ctx in (128, 512, 1024)]}
QUICK_SWEEP = {"prefill": [(c, h) for c in (8, 32) for h in (0, 64)],
               "decode": [(b, ctx) for b in (1, 4) for ctx in (16, 64)]}


@dataclass(frozen=True)
class Point:
    kind: str
    new_tokens: int
    pairs: int
    label: str
    seconds: float


def _engine(ex: TorchExecutor, blocks_needed: int) -> Engine:
    cfg = EngineConfig(block_size=16, num_blocks=blocks_needed + 64,
                       knobs=Knobs(max_num_batched_tokens=8192, chunk_size=8192,
                                   max_num_seqs=256, enable_prefix_caching=False,
                                   kv_format="fp32" if ex.device.type == "cpu" else "bf16"))
    return Engine(cfg, ex)


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [3 + (salt * 7919 + i * 104729) % (vocab - 3) for i in range(n)]


def _time_prefill(ex: TorchExecutor, c: int, h: int, repeats: int) -> float:
    vocab = ex.cfg.info.vocab_size
    times = []
    for r in range(repeats):
        e = _engine(ex, (h + c) // 16 + 2)
        # Compute h tokens (untimed), then time the step that adds a chunk of c.
        if h:
            e.add_request(_prompt(h + c, r, vocab), SamplingParams(max_tokens=1),
                          request_id="x")
            e.set_knobs(chunk_size=h)
            e.step()
            e.set_knobs(chunk_size=c)
            rec = e.step()
        else:
            e.add_request(_prompt(c, r, vocab), SamplingParams(max_tokens=1), request_id="x")
            rec = e.step()
        assert rec is not None and rec.dt is not None
        times.append(rec.dt)
        e.run_until_idle()
    return statistics.median(times)


def _time_decode(ex: TorchExecutor, b: int, ctx: int, steps: int) -> float:
    vocab = ex.cfg.info.vocab_size
    e = _engine(ex, b * (ctx // 16 + 2))
    for i in range(b):
        e.add_request(_prompt(ctx, i, vocab), SamplingParams(max_tokens=steps + 2,
                                                             ignore_eos=True))
    while any(not r.is_decoding for r in e.scheduler.running) or e.scheduler.waiting \
            or not e.scheduler.running:
        e.step()
    times = []
    for _ in range(steps):
        rec = e.step()
        assert rec is not None and rec.dt is not None
        times.append(rec.dt)
    seconds = statistics.median(times)
    e.run_until_idle()
    return seconds


def measure_machine() -> tuple[float, float]:
    """(read bandwidth in bytes/s, fp32 matmul FLOP/s) on the CPU, best of 5 each.

    Bandwidth: a 512 MiB fp32 matrix–vector product (memory-bound). Compute: a 2048³
    matrix product (compute-bound)."""
    import torch

    m, v = torch.randn(8192, 16384), torch.randn(16384)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best_mv = best_mm = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        m @ v
        best_mv = min(best_mv, time.perf_counter() - t)
        t = time.perf_counter()
        a @ b
        best_mm = min(best_mm, time.perf_counter() - t)
    return m.numel() * 4 / best_mv, 2 * 2048 ** 3 / best_mm


def fit_step_model(points: list[Point]) -> StepFit:
    """Non-negative least squares over (1, new tokens, pairs) by dropping negative terms."""
    cols = [0, 1, 2]
    a = np.array([[1.0, p.new_tokens, p.pairs] for p in points])
    y = np.array([p.seconds for p in points])
    while True:
        coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (coef >= 0).all():
            break
        cols.pop(int(np.argmin(coef)))
    full = [0.0, 0.0, 0.0]
    for c, v in zip(cols, coef, strict=True):
        full[c] = float(v)
    return StepFit(*full)


def sweep(ex: TorchExecutor, quick: bool = False, progress=print) -> list[Point]:
    plan = QUICK_SWEEP if quick else FULL_SWEEP
    points = []
    for c, h in plan["prefill"]:
        s = _time_prefill(ex, c, h, repeats=2 if quick else 3)
        points.append(Point("prefill", c, causal_pairs(c, h), f"prefill {c} on {h}", s))
        progress(f"  {points[-1].label}: {s * 1e3:.1f} ms")
    for b, ctx in plan["decode"]:
        s = _time_decode(ex, b, ctx, steps=3 if quick else 6)
        points.append(Point("decode", b, b * causal_pairs(1, ctx), f"decode {b} at {ctx}", s))
        progress(f"  {points[-1].label}: {s * 1e3:.1f} ms")
    return points


def hardware_name(ex: TorchExecutor) -> str:
    if ex.device.type == "cuda":
        import torch

        return "local-" + torch.cuda.get_device_name(ex.device).lower().replace(" ", "-")
    return f"local-cpu-{os.cpu_count()}c"


def write_profiles(ex: TorchExecutor, fit: StepFit, name: str, hw: str,
                   bandwidth: float, flops: float) -> tuple[Path, Path]:
    """Write models/<name>.toml (shape + fit for `hw`) and hardware/<hw>.toml."""
    info = ex.cfg.info
    d = user_profiles_dir()
    (d / "models").mkdir(parents=True, exist_ok=True)
    (d / "hardware").mkdir(parents=True, exist_ok=True)
    model_path = d / "models" / f"{name}.toml"
    bpw = ex.model.matrix_weight_bytes / max(ex.model.matrix_params, 1)
    model_path.write_text(
        f'# Written by kvdeck calibrate on {platform.node()} ({time.strftime("%Y-%m-%d")}).\n'
        f'name = "{name}"\narchitecture = "{info.architecture}"\n'
        f"num_layers = {info.num_layers}\nnum_heads = {info.num_heads}\n"
        f"num_kv_heads = {info.num_kv_heads}\nhead_dim = {info.head_dim}\n"
        f'kv_dtype = "{ex.kv_format}"\nweight_bytes = {info.weight_bytes}\n'
        f"matrix_weight_bytes = {ex.model.matrix_weight_bytes}\n"
        f"context_length = {info.context_length}\nbytes_per_weight = {bpw:.3f}\n\n"
        f"[fit.{hw}]\nfixed_ms = {fit.fixed_s * 1e3:.6f}\n"
        f"per_token_us = {fit.per_token_s * 1e6:.6f}\nper_pair_ns = {fit.per_pair_s * 1e9:.6f}\n"
    )
    hw_path = d / "hardware" / f"{hw}.toml"
    hw_path.write_text(
        f'# Written by kvdeck calibrate: this machine as measured.\nname = "{hw}"\n'
        f'description = "{platform.processor() or platform.machine()}, {ex.device.type}"\n'
        f"memory_bytes = {psutil.virtual_memory().total}\n"
        f"bandwidth_bytes_per_s = {bandwidth:.6g}\npeak_flops = {flops:.6g}\n\n"
        "# Both peaks were measured here, so they already include efficiency.\n"
        "[efficiency]\nmfu = 1.0\nmbu = 1.0\n"
    )
    return model_path, hw_path
