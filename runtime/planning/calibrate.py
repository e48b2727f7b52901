"""`kvdeck calibrate`: measure a real executor and fit the sim executor's step-time model.

The sweep times prefill chunks of `c` tokens on `h` cached ones and decode steps of `b`
requests at context `L`, through the real engine and KV manager. A least-squares fit of
`seconds = fixed + per_token × new_tokens + per_pair × causal_pairs [+ per_sample × sampled
rows + per_context × KV positions read]` (coefficients kept non-negative) is written as a
model profile plus a hardware profile for this machine, in the user profiles directory,
where the sim executor finds them by name.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.planning.machine import local_name
from kvdeck.runtime.planning.profiles import (
    ModelProfile,
    StepFit,
    user_profiles_dir,
)

if TYPE_CHECKING:  # torch is imported only by those who time an executor
    from kvdeck.runtime.executors.torch import TorchExecutor

FULL_SWEEP = {"prefill": [(c, h) for c in (16, 64, 256) for h in (0, 256, 1024)],
              "decode": [(b, ctx) for b in (1, 4, 16) for ctx in (128, 512, 1024)],
              "mixed": [(64, 512)]}
QUICK_SWEEP = {"prefill": [(c, h) for c in (8, 32) for h in (0, 64)],
               "decode": [(b, ctx) for b in (1, 4) for ctx in (16, 64)],
               "mixed": [(8, 64)]}
"""`mixed`: (prompt tokens, decode context) — a fresh prompt run in one step beside a
request decoding at that context."""


@dataclass(frozen=True)
class Point:
    kind: str
    new_tokens: int
    pairs: int
    label: str
    seconds: float
    context: int = 0
    """KV positions the step reads (for the bytes behind MBU)."""
    sampled: int = 1
    """Rows whose logits the step computes (a prefill chunk's last, every decode row)."""
    outside: bool = False
    """Timed by a client from sending to the first token: the request's way through the
    server is in it (`StepFit.overhead_s` takes it)."""
    idle_s: float = 0.0
    """Of a "wake" point: the idle seconds before its step, whose `seconds` are what the
    step took beyond the same step sent right after another (`wake.py`); no step shape."""
    pinned: bool = False
    """Of a decode point: its requests were sent to neighbouring slots of llama-server
    (`id_slot`), so that its rows ran as one pass (`executors/server_slots.py`)."""

    @property
    def step(self) -> bool:
        """A step's time, which the fit takes: not a wake's extra (what idling adds) or a
        slot's save (what a launch waits for), which are no step's shape."""
        return self.kind not in ("wake", "save")

    @property
    def mixed(self) -> bool:
        """A step that ran prompt tokens and a decode row together (kind "mixed")."""
        return self.kind == "mixed"


def mixed_point(c: int, ctx: int, seconds: float, label: str = "") -> Point:
    """A step that computed a fresh prompt of `c` tokens beside one decode row at context
    `ctx` (both sampled)."""
    return Point("mixed", c + 1, causal_pairs(c, 0) + causal_pairs(1, ctx),
                 label or f"prefill {c} beside decode 1 at {ctx}", seconds, c + ctx + 1, 2)


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


def _time_mixed(ex: TorchExecutor, c: int, ctx: int, repeats: int) -> float:
    vocab = ex.cfg.info.vocab_size
    times = []
    for r in range(repeats):
        e = _engine(ex, (ctx + c) // 16 + 8)
        e.add_request(_prompt(ctx, r, vocab), SamplingParams(max_tokens=4, ignore_eos=True))
        while not e.scheduler.running or not e.scheduler.running[0].is_decoding:
            e.step()
        e.add_request(_prompt(c, r + 1, vocab), SamplingParams(max_tokens=1))
        rec = e.step()  # the decode row and the whole prompt, in one step
        assert rec is not None and rec.dt is not None
        times.append(rec.dt)
        e.run_until_idle()
    return statistics.median(times)


def efficiencies(points: list[Point], model: ModelProfile, bandwidth: float, flops: float
                 ) -> tuple[float, float]:
    """(MFU, MBU) this model's steps reach against the measured peaks: the best prefill
    point's FLOP rate (`2·params·n + 4·pairs·heads·d·layers` per step) over the matmul peak,
    and the best decode point's read rate (`D_w + context·k` per step) over the read
    bandwidth; each at most 1."""
    k = model.kv_bytes_per_token()
    rates_f = [(2.0 * model.matrix_params * p.new_tokens
                + 4.0 * p.pairs * model.num_heads * model.head_dim * model.num_layers)
               / p.seconds for p in points if p.kind == "prefill"]
    rates_b = [(model.matrix_weight_bytes + p.context * k) / p.seconds
               for p in points if p.kind == "decode"]
    mfu = max(rates_f, default=0.0) / flops
    mbu = max(rates_b, default=0.0) / bandwidth
    return min(max(mfu, 1e-6), 1.0), min(max(mbu, 1e-6), 1.0)


def point_seconds(fit: StepFit, p: Point) -> float:
    """What `fit` gives for the step `p` timed, as `p` was timed (a point timed from outside
    carries the request's way through the server)."""
    return fit.seconds(p.new_tokens, p.pairs, p.sampled, p.context, p.mixed) \
        + (fit.overhead_s if p.outside else 0.0)


def fit_step_model(points: list[Point]) -> StepFit:
    """Non-negative least squares over (1, new tokens, pairs, sampled rows, timed from
    outside, KV positions read, mixed) by dropping negative terms. A column is left out where
    the points cannot tell it from the others (every point samples as many rows as it has
    tokens, or reads one position per pair); the outside term (a request's way through the
    server) only where some points, and not all, were timed from a client; the mixed term
    (what a step carrying both prompt tokens and decode rows costs beyond them) only where
    such a step was timed."""
    points = [p for p in points if p.step]
    a = np.array([[1.0, p.new_tokens, p.pairs, p.sampled, float(p.outside), p.context,
                   float(p.mixed)] for p in points])
    cols = [0, 1, 2]
    for c in (3, 4, 5, 6):
        # A column the others already span would only split their coefficients at random.
        if np.linalg.matrix_rank(a[:, [*cols, c]]) > np.linalg.matrix_rank(a[:, cols]):
            cols.append(c)
    y = np.array([p.seconds for p in points])
    while True:
        coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (coef >= 0).all():
            break
        cols.pop(int(np.argmin(coef)))
    full = [0.0] * 7
    for c, v in zip(cols, coef, strict=True):
        full[c] = float(v)
    return StepFit(full[0], full[1], full[2], per_sample_s=full[3], overhead_s=full[4],
                   per_context_s=full[5], mixed_s=full[6])


def sweep(ex: TorchExecutor, quick: bool = False, progress=print) -> list[Point]:
    plan = QUICK_SWEEP if quick else FULL_SWEEP
    points = []
    for c, h in plan["prefill"]:
        s = _time_prefill(ex, c, h, repeats=2 if quick else 3)
        points.append(Point("prefill", c, causal_pairs(c, h), f"prefill {c} on {h}", s, h + c))
        progress(f"  {points[-1].label}: {s * 1e3:.1f} ms")
    for b, ctx in plan["decode"]:
        s = _time_decode(ex, b, ctx, steps=3 if quick else 6)
        points.append(Point("decode", b, b * causal_pairs(1, ctx), f"decode {b} at {ctx}", s,
                            b * (ctx + 1), b))
        progress(f"  {points[-1].label}: {s * 1e3:.1f} ms")
    for c, ctx in plan["mixed"]:
        s = _time_mixed(ex, c, ctx, repeats=2 if quick else 3)
        points.append(mixed_point(c, ctx, s))
        progress(f"  {points[-1].label}: {s * 1e3:.1f} ms")
    return points


def hardware_name(ex: TorchExecutor) -> str:
    return local_name(str(ex.device))


def model_toml(m: ModelProfile) -> str:
    """A model profile's shape and weight groups, as its TOML file states them."""
    return (f'name = "{m.name}"\narchitecture = "{m.architecture}"\n'
            f"num_layers = {m.num_layers}\nnum_heads = {m.num_heads}\n"
            f"num_kv_heads = {m.num_kv_heads}\nhead_dim = {m.head_dim}\n"
            f'kv_dtype = "{m.kv_dtype}"\nweight_bytes = {m.weight_bytes}\n'
            f"matrix_weight_bytes = {m.matrix_weight_bytes}\n"
            f"context_length = {m.context_length}\nbytes_per_weight = {m.bytes_per_weight:.3f}\n"
            f"sliding_window = {m.sliding_window}\nnum_local_layers = {m.num_local_layers}\n\n"
            + ("# Matrix bytes per weight group, from the GGUF's tensors.\n[weight_groups]\n"
               + "".join(f"{g} = {b}\n" for g, b in m.group_bytes.items()) + "\n"
               if m.group_bytes else ""))


def fit_toml(fit: StepFit, hw: str, points: list[Point]) -> str:
    """`[fit.<hw>]` and, where decode or prefill steps were measured, `[decode.<hw>]` and
    `[prefill.<hw>]` (a step timed from outside without the request's way through the
    server, which the fit took apart); where waking from idle was, `[wake.<hw>]`; where a
    slot's save to llama-server's prompt cache was, `[slot_save.<hw>]`."""
    decode = [p for p in points if p.kind == "decode"]
    # A step timed from outside less the fitted way through the server; a point that
    # leaves nothing of its step (a fit that put it all in the way) gives no correction.
    prefill = [(p, p.seconds - (fit.overhead_s if p.outside else 0.0))
               for p in points if p.kind == "prefill"]
    prefill = [(p, s) for p, s in prefill if round(s * 1e3, 3) > 0]
    wake = [p for p in points if p.kind == "wake"]
    saves = [p for p in points if p.kind == "save"]
    rows = [p for p in decode if p.new_tokens > 1]
    pinned = ("# Their rows ran in neighbouring slots (llama-server's id_slot): one pass "
              "each.\npinned = true\n" if rows and all(p.pinned for p in rows) else "")
    return (f"[fit.{hw}]\n" + "".join(f"{k} = {v:.6f}\n" for k, v in fit.to_json().items())
            + (f"\n# Measured decode steps, [batch, context, ms]: kvdeck plan interpolates them.\n"
               f"[decode.{hw}]\npoints = [" + ", ".join(
                   f"[{p.new_tokens}, {p.context // p.new_tokens - 1}, {p.seconds * 1e3:.3f}]"
                   for p in decode) + "]\n" + pinned if decode else "")
            + (f"\n# Measured prefill steps, [new tokens, cached tokens, ms]: fitted prefill "
               f"steps are corrected by them.\n[prefill.{hw}]\npoints = [" + ", ".join(
                   f"[{p.new_tokens}, {p.context - p.new_tokens}, {s * 1e3:.3f}]"
                   for p, s in prefill) + "]\n" if prefill else "")
            + (f"\n# The first step after an idle spell, [idle seconds, extra ms]: the sim adds "
               f"it.\n[wake.{hw}]\npoints = [" + ", ".join(
                   f"[{p.idle_s:g}, {max(p.seconds, 0.0) * 1e3:.3f}]" for p in wake)
               + "]\n" if wake else "")
            + (f"\n# Saving a slot's state to llama-server's prompt cache, [tokens, ms]: the "
               f"sim's\n# --server-slots holds a launch for the saves it makes.\n"
               f"[slot_save.{hw}]\npoints = [" + ", ".join(
                   f"[{p.new_tokens}, {p.seconds * 1e3:.3f}]" for p in saves)
               + "]\n" if saves else ""))


def hardware_toml(name: str, description: str, memory: int, bandwidth: float, flops: float,
                  link: float, mfu: float, mbu: float, model: str, source: str) -> str:
    """A hardware profile: `source` says where its peaks came from."""
    return (f'name = "{name}"\ndescription = "{description}"\n'
            f"memory_bytes = {memory}\n"
            f"bandwidth_bytes_per_s = {bandwidth:.6g}  # {source}\n"
            f"peak_flops = {flops:.6g}\n\n"
            + (f"[link]\nbandwidth_bytes_per_s = {link:.6g}  # measured copy, slower way\n\n"
               if link else "")
            + f"# What {model}'s steps reached against those peaks: the best prefill point's\n"
            "# FLOP rate (MFU) and the best decode point's bytes read per second (MBU).\n"
            f"[efficiency]\nmfu = {mfu:.4f}\nmbu = {mbu:.4f}\n")


def profile_paths(name: str, hw: str) -> tuple[Path, Path]:
    """Where calibration writes model profile `name` and hardware profile `hw` (the user
    profiles directory, made if missing)."""
    d = user_profiles_dir()
    (d / "models").mkdir(parents=True, exist_ok=True)
    (d / "hardware").mkdir(parents=True, exist_ok=True)
    return d / "models" / f"{name}.toml", d / "hardware" / f"{hw}.toml"


def write_profiles(ex: TorchExecutor, fit: StepFit, name: str, hw: str,
                   bandwidth: float, flops: float, points: list[Point] | None = None,
                   link: float = 0.0) -> tuple[Path, Path]:
    """Write models/<name>.toml (shape, sliding-window layers, fit for `hw`) and
    hardware/<hw>.toml (measured peaks, link, and the MFU and MBU the points reached)."""
    info = ex.cfg.info
    model_path, hw_path = profile_paths(name, hw)
    model = ModelProfile(
        name, info.architecture, info.num_layers, info.num_heads, info.num_kv_heads,
        info.head_dim, ex.kv_format, info.weight_bytes, ex.model.matrix_weight_bytes,
        info.context_length, ex.model.matrix_weight_bytes / max(ex.model.matrix_params, 1),
        sliding_window=info.sliding_window or 0,
        num_local_layers=len(info.sliding_window_layers) if info.sliding_window else 0,
        group_bytes=dict(info.group_bytes))
    model_path.write_text(
        f'# Written by kvdeck calibrate on {platform.node()} ({time.strftime("%Y-%m-%d")}).\n'
        + model_toml(model) + fit_toml(fit, hw, points or []))
    mfu, mbu = efficiencies(points or [], ModelProfile.load(name), bandwidth, flops) \
        if points else (0.5, 0.5)
    hw_path.write_text(
        "# Written by kvdeck calibrate: this machine as measured.\n"
        + hardware_toml(hw, f"{platform.processor() or platform.machine()}, {ex.device.type}",
                        psutil.virtual_memory().total, bandwidth, flops, link, mfu, mbu, name,
                        "a 512 MiB matrix-vector product; peak_flops: a 2048³ matrix product"))
    return model_path, hw_path
