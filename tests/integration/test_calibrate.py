"""`kvdeck calibrate` on a tiny model, and the sim executor using what it wrote; the torch
executor driven by `kvdeck run-trace`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.planning.calibrate import (
    Point,
    efficiencies,
    fit_step_model,
    fit_toml,
    mixed_point,
    point_seconds,
)
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from kvdeck.runtime.resources import profiles_dir
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.views.snapshot import snapshot_of


def kvdeck(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


def test_fit_recovers_known_coefficients() -> None:
    truth = (0.02, 3e-5, 2e-9)
    pts = [Point("x", n, causal_pairs(n, h), "", truth[0] + truth[1] * n
                 + truth[2] * causal_pairs(n, h)) for n in (1, 16, 256) for h in (0, 512, 4096)]
    fit = fit_step_model(pts)
    assert fit.fixed_s == pytest.approx(truth[0]) and fit.per_token_s == pytest.approx(truth[1])
    assert fit.per_pair_s == pytest.approx(truth[2])
    # A negative least-squares term is dropped rather than kept.
    flat = [Point("x", n, p, "", 0.01) for n, p in ((1, 10), (2, 5), (4, 100))]
    assert min(vars(fit_step_model(flat)).values()) >= 0


def test_fit_recovers_the_cost_of_sampled_rows() -> None:
    """Prefill chunks sample one row, decode steps every row: a wide head shows as a
    per-sample term the other three cannot absorb."""
    truth = (0.05, 4e-4, 1e-6, 2e-3)
    pts = [Point("prefill", c, causal_pairs(c, h), "", truth[0] + truth[1] * c
                 + truth[2] * causal_pairs(c, h) + truth[3], h + c, 1)
           for c in (16, 64, 256) for h in (0, 256, 1024)]
    pts += [Point("decode", b, b * causal_pairs(1, L), "", truth[0] + truth[1] * b
                  + truth[2] * b * causal_pairs(1, L) + truth[3] * b, b * (L + 1), b)
            for b in (1, 4, 16) for L in (128, 512, 1024)]
    fit = fit_step_model(pts)
    assert (fit.fixed_s, fit.per_token_s, fit.per_pair_s, fit.per_sample_s) == \
        pytest.approx(truth)


def test_fit_tells_a_position_read_from_a_pair_computed() -> None:
    """A decode row reads its whole context for one pair each; a prefill chunk reads h + c
    positions for c·h + c(c+1)/2 pairs. Steps that pay for reading apart from computing are
    priced right at both ends only with both terms (one pair term missed llama.cpp's deep
    decode steps), and points with prefills on no history alone cannot separate them."""
    truth = (0.002, 5e-5, 2e-9, 3e-4, 4e-7)  # fixed, token, pair, sample, position read

    def point(kind: str, n: int, pairs: int, context: int, sampled: int) -> Point:
        s = truth[0] + truth[1] * n + truth[2] * pairs + truth[3] * sampled \
            + truth[4] * context
        return Point(kind, n, pairs, "", s, context, sampled)

    pts = [point("prefill", c, causal_pairs(c, h), h + c, 1)
           for c in (64, 256, 512) for h in (0, 256, 512)]
    pts += [point("decode", b, b * causal_pairs(1, L), b * (L + 1), b)
            for b in (1, 2, 4) for L in (128, 512, 1024)]
    fit = fit_step_model(pts)
    assert (fit.fixed_s, fit.per_token_s, fit.per_pair_s, fit.per_sample_s,
            fit.per_context_s) == pytest.approx(truth)
    deep = Point("decode", 8, 8 * causal_pairs(1, 4096), "", 0.0, 8 * 4097, 8)
    assert fit.seconds(deep.new_tokens, deep.pairs, deep.sampled, deep.context) == \
        pytest.approx(point("decode", 8, deep.pairs, deep.context, 8).seconds)
    # Decode rows read one position per pair: without prefills on history, nothing tells
    # the position term from the pair term, and the fit keeps the pair term alone.
    only_decode = [p for p in pts if p.kind == "decode"]
    assert fit_step_model(only_decode).per_context_s == 0.0


def test_efficiencies_are_the_best_points_against_the_peaks() -> None:
    model = ModelProfile("m", "llama", 2, 4, 2, 8, "fp32", 4_000_000, 4_000_000, 4096, 4.0)
    k = model.kv_bytes_per_token()  # 2 × 2 layers × 2 heads × 8 × 4 B = 256
    pts = [Point("prefill", 100, causal_pairs(100, 0), "", 0.5, 100, 1),
           Point("decode", 2, 2 * 11, "", 0.01, 2 * 11, 2)]
    flops = 2.0 * 1_000_000 * 100 + 4.0 * causal_pairs(100, 0) * 4 * 8 * 2
    mfu, mbu = efficiencies(pts, model, bandwidth=1e9, flops=1e9)
    assert mfu == pytest.approx(flops / 0.5 / 1e9)
    assert mbu == pytest.approx((4_000_000 + 22 * k) / 0.01 / 1e9)
    assert efficiencies(pts, model, bandwidth=1e3, flops=1e3) == (1.0, 1.0)  # capped at 1


def test_calibrate_writes_profiles_the_sim_can_use(tiny_llama: Path, tmp_path: Path,
                                                   monkeypatch) -> None:
    env = {"KVDECK_CACHE": str(tmp_path)}
    r = kvdeck("calibrate", str(tiny_llama), "--quick", "--device", "cpu", "--name", "tiny",
               "--json", env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert len(data["points"]) == 9 and all(p["measured_ms"] > 0 for p in data["points"])
    assert data["points"][-1]["point"] == "prefill 8 beside decode 1 at 64"
    assert min(data["fit"].values()) >= 0
    hw = Path(data["hardware_profile"]).stem
    code = (
        "from kvdeck.runtime.executors.sim import SimConfig, SimExecutor\n"
        f"s = SimExecutor(SimConfig(model_profile='tiny', hardware='{hw}'))\n"
        "print(s.fit.fixed_s * 1e3, s.model.num_layers, s.kv_bytes_per_token('fp32'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=60)
    assert out.returncode == 0, out.stderr
    fixed_ms, layers, kv = out.stdout.split()
    assert float(fixed_ms) == pytest.approx(data["fit"]["fixed_ms"], rel=1e-5)
    assert int(layers) == 2 and int(kv) == 2 * 2 * 2 * 16 * 4
    # The hardware profile carries measured efficiencies and the link, not 1.0 placeholders.
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    measured = HardwareProfile.load(hw)
    decode = ModelProfile.load("tiny").decode_times[hw]
    assert (measured.mfu, measured.mbu) == (data["mfu"], data["mbu"])
    assert 0 < measured.mbu < 1 and 0 < measured.mfu <= 1
    # The measured decode steps the planner interpolates: (batch, context, seconds).
    steps = {(p["point"], round(p["measured_ms"], 3)) for p in data["points"]
             if p["point"].startswith("decode")}
    assert {(f"decode {b} at {c}", round(s * 1e3, 3)) for b, c, s in decode} == steps
    # The measured prefill steps too, each as [new tokens, cached tokens, seconds].
    prefills = {(f"prefill {n} on {h}", round(s * 1e3, 3))
                for n, h, s in ModelProfile.load("tiny").prefill_times[hw]}
    assert prefills == {(p["point"], round(p["measured_ms"], 3)) for p in data["points"]
                        if p["point"].startswith("prefill") and "beside" not in p["point"]}
    assert measured.link_bandwidth_bytes_per_s == pytest.approx(data["link_bytes_per_s"], rel=1e-5)

    # With the machine calibrated, a real executor's steps get the roofline readout: its
    # own bytes read against the peaks calibration measured.
    engine = Engine(EngineConfig(kv_memory_bytes=4 << 20),
                    TorchExecutor(tiny_llama, device="cpu", dtype="fp32"))
    engine.add_request(list(range(5, 45)), SamplingParams(max_tokens=3))
    while engine.has_work:
        engine.step()
    last = engine.last_step[0]
    roof = snapshot_of(engine).roofline
    assert roof is not None and roof.step == last.step and roof.bytes_read == last.bytes_read
    assert roof.memory_s == pytest.approx(last.bytes_read / measured.bandwidth_bytes_per_s)
    assert roof.seconds == last.dt and roof.bound in ("memory", "compute", "overhead")
    engine.close()


def test_run_trace_on_the_torch_executor(tiny_llama: Path, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"arrival_s": 0.01 * i, "prompt_len": 40 + 3 * i, "output_len": 5,
                    "prefix_group": "s", "prefix_len": 32}) + "\n" for i in range(6)))
    cfg = tmp_path / "c.toml"
    cfg.write_text('kv_format = "fp32"\nkv_memory_bytes = 4194304\n')
    r = kvdeck("run-trace", str(trace), "--executor", "torch", "--model", str(tiny_llama),
               "--device", "cpu", "--config", str(cfg), "--json", env={})
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    s = result["summary"]
    assert s["executor"] == "torch" and s["statuses"] == {"finished_length": 6}
    assert s["prefix_hit_tokens"] > 0
    assert all(len(q["itls"]) == 4 for q in result["requests"])


def test_fit_keeps_a_servers_overhead_apart_from_its_steps() -> None:
    """Prefill points timed by a client carry the request's way through the server; decode
    gaps do not. The fit takes that way as `overhead_s`, not into the steps' fixed term."""
    fixed, per_token, per_pair, per_sample, overhead = 0.02, 3e-5, 2e-9, 1e-3, 0.009
    pts = [Point("prefill", c, causal_pairs(c, 0), "", fixed + per_token * c
                 + per_pair * causal_pairs(c, 0) + per_sample + overhead, c, outside=True)
           for c in (64, 256, 1024)]
    pts += [Point("decode", b, b * causal_pairs(1, h), "", fixed + per_token * b
                  + per_pair * b * causal_pairs(1, h) + per_sample * b, b * (h + 1), b)
            for b in (1, 4, 8) for h in (256, 1024)]
    fit = fit_step_model(pts)
    assert fit.overhead_s == pytest.approx(overhead) and fit.fixed_s == pytest.approx(fixed)
    assert fit.per_sample_s == pytest.approx(per_sample)
    assert fit_step_model([dataclasses.replace(p, outside=False) for p in pts]).overhead_s == 0


def probed_profiles(tmp_path: Path, monkeypatch) -> tuple[Path, str]:
    """A user profiles folder under `tmp_path` with hardware `rtx-pro-6000-probed` (the
    shipped card under a name no shipped model profile has a fit for): the models folder
    to write into, and the shipped qwen3-8b profile's text to start from."""
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    models = tmp_path / "profiles" / "models"
    models.mkdir(parents=True)
    hw = tmp_path / "profiles" / "hardware"
    hw.mkdir(parents=True)
    hw.joinpath("rtx-pro-6000-probed.toml").write_text(
        (profiles_dir() / "hardware" / "rtx-pro-6000.toml").read_text().replace(
            'name = "rtx-pro-6000"', 'name = "rtx-pro-6000-probed"'))
    return models, (profiles_dir() / "models" / "qwen3-8b.toml").read_text()


def test_fit_keeps_the_cost_of_a_step_mixing_prompt_and_decode_apart() -> None:
    """A step that runs a prompt beside decode rows can cost more than its tokens (two
    attention paths in one step); one timed such step gives the fit its mixed term, and
    without one the term is 0 rather than a guess."""
    fixed, per_token, per_pair, per_sample, mixed = 0.02, 3e-4, 2e-9, 4e-3, 0.045

    def cost(n: int, pairs: int, sampled: int, is_mixed: bool) -> float:
        return fixed + per_token * n + per_pair * pairs + per_sample * sampled \
            + (mixed if is_mixed else 0.0)

    pts = [Point("prefill", c, causal_pairs(c, 0), "", cost(c, causal_pairs(c, 0), 1, False),
                 c, 1) for c in (64, 256, 512)]
    pts += [Point("decode", b, b * causal_pairs(1, h), "",
                  cost(b, b * causal_pairs(1, h), b, False), b * (h + 1), b)
            for b in (1, 4, 8) for h in (64, 384)]
    plain = fit_step_model(pts)
    assert plain.mixed_s == 0.0
    pairs = causal_pairs(64, 0) + causal_pairs(1, 400)
    pts.append(mixed_point(64, 400, cost(65, pairs, 2, True)))
    fit = fit_step_model(pts)
    assert fit.mixed_s == pytest.approx(mixed) and fit.fixed_s == pytest.approx(fixed)
    assert point_seconds(fit, pts[-1]) == pytest.approx(pts[-1].seconds)


def test_the_sim_prices_a_step_mixing_prompt_and_decode_with_the_fits_mixed_term(
        tmp_path: Path, monkeypatch) -> None:
    models, shipped = probed_profiles(tmp_path, monkeypatch)
    for name, mixed in (("plain", 0), ("mixing", 30)):
        (models / f"{name}.toml").write_text(
            shipped.replace('name = "qwen3-8b"', f'name = "{name}"')
            + "\n[fit.rtx-pro-6000-probed]\nfixed_ms = 20\nper_token_us = 30\n"
            f"per_pair_ns = 0\nmixed_ms = {mixed}\n")
    times = {}
    for name in ("plain", "mixing"):
        engine = Engine(EngineConfig(kv_memory_bytes=1 << 30, block_size=16), SimExecutor(
            SimConfig(model_profile=name, hardware="rtx-pro-6000-probed", timing="fit")))
        engine.add_request(list(range(10, 42)), SamplingParams(max_tokens=6))
        first = engine.step()  # the first prompt alone
        engine.add_request(list(range(50, 66)), SamplingParams(max_tokens=2))
        both = engine.step()  # its decode row beside the second prompt
        assert both.num_decode == 1 and len(both.plan) == 2
        times[name] = (first.dt, both.dt)
        engine.run_until_idle()
        engine.close()
    assert times["mixing"][0] == pytest.approx(times["plain"][0])
    assert times["mixing"][1] - times["plain"][1] == pytest.approx(0.030)


def test_measured_prefill_steps_correct_the_fit_where_they_were_measured(
        tmp_path: Path, monkeypatch) -> None:
    """A linear fit through prefill steps that are not linear in their tokens misses each;
    the profile's measured steps put a step of a measured shape at its measured time, and
    steps between them at a ratio between theirs."""
    models, shipped = probed_profiles(tmp_path, monkeypatch)
    fit = "\n[fit.rtx-pro-6000-probed]\nfixed_ms = 20\nper_token_us = 100\nper_pair_ns = 0\n"
    # The fit prices 32 tokens at 23.2 ms and 128 at 32.8 ms; they were measured at 29 and
    # 30 ms.
    measured = ("\n[prefill.rtx-pro-6000-probed]\n"
                "points = [[32, 0, 29.0], [128, 0, 30.0], [16, 512, 40.0]]\n")
    (models / "measured.toml").write_text(
        shipped.replace('name = "qwen3-8b"', 'name = "measured"') + fit + measured)
    model = ModelProfile.load("measured")
    linear = model.fits["rtx-pro-6000-probed"]
    assert model.prefill_times["rtx-pro-6000-probed"] == \
        ((32, 0, 0.029), (128, 0, 0.030), (16, 512, 0.040))
    # 16 tokens on 512 cached: the fit's 21.6 ms, measured at 40 (cached tokens count).
    assert model.prefill_factor("rtx-pro-6000-probed", linear, 16, 512) == \
        pytest.approx(40.0 / 21.6)
    assert model.prefill_factor("rtx-pro-6000-probed", linear, 32, 0) == \
        pytest.approx(29.0 / 23.2)
    between = model.prefill_factor("rtx-pro-6000-probed", linear, 64, 0)
    assert 30.0 / 32.8 < between < 29.0 / 23.2
    assert model.prefill_factor("elsewhere", linear, 32, 0) == 1.0
    engine = Engine(EngineConfig(kv_memory_bytes=1 << 30, block_size=16), SimExecutor(
        SimConfig(model_profile="measured", hardware="rtx-pro-6000-probed", timing="fit")))
    engine.add_request(list(range(10, 42)), SamplingParams(max_tokens=2))
    assert engine.step().dt == pytest.approx(0.029)  # the prompt alone: the measured step
    assert engine.step().dt == pytest.approx(linear.seconds(1, 33, 0, 33))  # a decode: the fit
    engine.run_until_idle()
    # Two prompts in one step are a shape no measured step had: the fit prices it.
    engine.add_request(list(range(100, 132)), SamplingParams(max_tokens=1))
    engine.add_request(list(range(200, 232)), SamplingParams(max_tokens=1))
    both = engine.step()
    assert len(both.plan) == 2 and both.dt == pytest.approx(linear.seconds(64, 0, 0, 64))
    engine.close()
    # Under execution shapes a prompt's rows are padded; the padding caches nothing.
    padded = Engine(EngineConfig(kv_memory_bytes=1 << 30, block_size=16), SimExecutor(
        SimConfig(model_profile="measured", hardware="rtx-pro-6000-probed", timing="fit",
                  graph_buckets="16,32")))
    padded.add_request(list(range(10, 15)), SamplingParams(max_tokens=1))
    step = padded.step()
    assert step.padding == 11 and step.dt > 0
    padded.close()
    # A table that is not [tokens, cached, ms] triples is one sentence.
    (models / "bad.toml").write_text(
        shipped.replace('name = "qwen3-8b"', 'name = "bad"') + fit
        + "\n[prefill.rtx-pro-6000-probed]\npoints = [[32, 29.0]]\n")
    with pytest.raises(ConfigError, match="new tokens, cached tokens, milliseconds"):
        ModelProfile.load("bad")



def two_rows_decoding(profile: str, hw: str, server_slots: int = 0) -> float:
    """The sim's step of two 100-token prompts' first decode rows (their prompts ran
    together in the step before it)."""
    engine = Engine(EngineConfig(kv_memory_bytes=1 << 30, block_size=16), SimExecutor(
        SimConfig(model_profile=profile, hardware=hw, timing="fit",
                  server_slots=server_slots)))
    engine.add_request(list(range(10, 110)), SamplingParams(max_tokens=3))
    engine.add_request(list(range(200, 300)), SamplingParams(max_tokens=3))
    assert len(engine.step().plan) == 2  # both prompts in one step
    dt = engine.step().dt
    engine.run_until_idle()
    engine.close()
    return dt


def test_measured_decode_steps_correct_the_fit_between_and_beyond_them(
        tmp_path: Path, monkeypatch) -> None:
    """A server whose decode step is not linear in its rows (one row after another up to
    three, then batched) is off a line through its steps; the profile's measured decode
    steps put a step of a measured shape at its measured time, a batch between two measured
    ones at a ratio between theirs, and a context past the measured ones at the nearest
    one's ratio over the fit."""
    models, shipped = probed_profiles(tmp_path, monkeypatch)
    # Every decode row costs 1 ms over 20 ms fixed: b rows at 20 + b ms, at any context.
    fit = ("\n[fit.rtx-pro-6000-probed]\nfixed_ms = 20\nper_token_us = 1000\n"
           "per_pair_ns = 0\n")
    measured = ("\n[decode.rtx-pro-6000-probed]\n"
                "points = [[1, 100, 21.0], [2, 100, 44.0], [4, 100, 36.0], [2, 400, 33.0]]\n")
    (models / "rows.toml").write_text(
        shipped.replace('name = "qwen3-8b"', 'name = "rows"') + fit + measured)
    model = ModelProfile.load("rows")
    hw, linear = "rtx-pro-6000-probed", model.fits["rtx-pro-6000-probed"]
    assert model.decode_factor(hw, linear, 1, 100) == pytest.approx(1.0)
    assert model.decode_factor(hw, linear, 2, 100) == pytest.approx(44 / 22)
    assert model.decode_factor(hw, linear, 4, 100) == pytest.approx(36 / 24)
    # Three rows: halfway between two's ratio and four's.
    assert model.decode_factor(hw, linear, 3, 100) == pytest.approx((2.0 + 1.5) / 2)
    # Two rows at 200: along two's ratios in log context; past 400, 400's ratio.
    along = (math.log2(201) - math.log2(101)) / (math.log2(401) - math.log2(101))
    assert model.decode_factor(hw, linear, 2, 200) == pytest.approx(2.0 - 0.5 * along)
    assert model.decode_factor(hw, linear, 2, 5000) == pytest.approx(33 / 22)
    # Past the largest batch measured, its ratio; elsewhere, none.
    assert model.decode_factor(hw, linear, 8, 100) == pytest.approx(1.5)
    assert model.decode_factor("elsewhere", linear, 2, 100) == 1.0
    # Both decode on 100 positions: the measured 44 ms, where the fit says 22.
    assert two_rows_decoding("rows", hw) == pytest.approx(0.044)
    # Behind llama-server's 4 slots only the steps of one row and of four surely ran as one
    # pass: the two rows, in neighbouring slots, are one pass priced between those ratios
    # (1.0 and 1.5), not at the two rows' measured 44 ms (two passes on that server).
    assert two_rows_decoding("rows", hw, server_slots=4) == \
        pytest.approx(0.022 * (1.0 + 0.5 / 3))
    # Probes pinned to neighbouring slots (`pinned`, as `calibrate --url` writes it behind
    # llama-server) each ran as one pass: the two rows take their measured 44 ms.
    pinned = fit_toml(linear, hw, [Point("decode", b, 0, "", ms / 1e3, b * (c + 1), b,
                                         pinned=b > 1)
                                   for b, c, ms in ((1, 100, 21.0), (2, 100, 44.0),
                                                    (4, 100, 36.0), (2, 400, 33.0))])
    assert "\npinned = true\n" in pinned
    (models / "pinned.toml").write_text(
        shipped.replace('name = "qwen3-8b"', 'name = "pinned"') + "\n" + pinned)
    assert ModelProfile.load("pinned").decode_pinned == {hw}
    assert ModelProfile.load("rows").decode_pinned == frozenset()
    assert two_rows_decoding("pinned", hw, server_slots=4) == pytest.approx(0.044)
    # One unpinned point of several rows among them: none of them is taken for one pass.
    mixed = fit_toml(linear, hw, [Point("decode", 2, 0, "", 0.044, 202, 2, pinned=True),
                                  Point("decode", 4, 0, "", 0.036, 404, 4)])
    assert "pinned" not in mixed


def test_a_sim_fitted_from_outside_takes_requests_in_after_their_way_through_http(
        tmp_path: Path, monkeypatch) -> None:
    models, shipped = probed_profiles(tmp_path, monkeypatch)
    (models / "outside.toml").write_text(shipped.replace('name = "qwen3-8b"',
                                                         'name = "outside"') +
                                         "\n[fit.rtx-pro-6000-probed]\nfixed_ms = 20\n"
                                         "per_token_us = 30\nper_pair_ns = 0\n"
                                         "per_sample_us = 0\noverhead_ms = 9\n")
    sim = SimExecutor(SimConfig(model_profile="outside", hardware="rtx-pro-6000-probed",
                                timing="fit"))
    assert sim.request_overhead_s == pytest.approx(0.009)
    engine = Engine(EngineConfig(kv_memory_bytes=1 << 30), sim)
    out = run_arrivals(engine, [Arrival(1.0, 100, 2)], vocab_size=32_000)["requests"][0]
    # Sent at 1.0 s, taken in 9 ms later, then one prefill step of 100 tokens.
    assert out["ttft"] == pytest.approx(0.009 + 0.020 + 100 * 30e-6)
