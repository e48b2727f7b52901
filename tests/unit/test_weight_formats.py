"""Weight formats: each packed matrix equals its dequantize-then-matmul reference (random
data, a tall head-like matrix included), byte counts, the knob's grammar, the kernel table's
rules, and the sim's pricing."""

from __future__ import annotations

import json

import pytest
import torch

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.models.kernels import (
    CPU_DTYPE_GAIN,
    NEVER,
    KernelTable,
    cpu_compute_dtype,
    load_or_measure,
    stale,
)
from kvdeck.runtime.models.linear import AutoMatrix, WeightOnlyInt4, WeightOnlyInt8, pack_matrix
from kvdeck.runtime.models.weight_formats import format_weight_format, parse_weight_format

# Attention, FFN down, and a head's shape with fewer rows: the kernels treat every output row
# alike, so Gemma 3's 262,144 rows test nothing 16,384 do not (and took minutes in int4).
SHAPES = [(384, 640), (640, 2048), (16_384, 640)]


def reference(m, x: torch.Tensor) -> torch.Tensor:
    """Dequantize, then multiply in float32 (activations rounded as the kernel rounds them)."""
    return x.to(m.dtype).float() @ m.dequantized().t()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("make", [
    lambda w, d: WeightOnlyInt8(w, None, d, 0),
    lambda w, d: WeightOnlyInt8(w, None, d, 64),
    lambda w, d: WeightOnlyInt8(w, None, d, 0, gemm_from_rows=NEVER),
    lambda w, d: WeightOnlyInt8(w, None, d, 64, gemm_from_rows=NEVER),
    lambda w, d: WeightOnlyInt4(w, None, d, 32),
    lambda w, d: WeightOnlyInt4(w, None, d, 128),
], ids=["int8-per-channel", "int8-g64", "int8-per-channel-packed", "int8-g64-packed",
        "int4-g32", "int4-g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_matmul_equals_dequantize_then_matmul(shape, make, dtype) -> None:
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g) * 0.05
    m = make(w, dtype)
    x = torch.randn(5, shape[1], generator=g)
    y = m(x)
    assert y.dtype == x.dtype and y.shape == (5, shape[0])
    ref = reference(m, x)
    # Tolerance: float32 accumulation order (fp32), or the kernel's bf16 output rounding
    # (2^-8 relative) plus its accumulation (bf16).
    tol = 1e-4 if dtype == torch.float32 else 1.5e-2
    assert (y - ref).abs().max() <= tol * ref.abs().max()
    # And the codes stand for the weights: within half a quantization step per value.
    step = {"int8": 1 / 127, "int4": 1 / 15}[m.format]
    err = (m.dequantized() - w).abs().max()
    assert err <= step * w.abs().max() * 1.01


def test_bytes_per_format() -> None:
    w = torch.randn(256, 640)
    assert pack_matrix(w, None, "dense", torch.float32).num_bytes == 256 * 640 * 4
    assert pack_matrix(w, None, "dense", torch.bfloat16).num_bytes == 256 * 640 * 2
    # int8: a byte a weight + a bf16 scale per output channel per group of 64 inputs.
    assert WeightOnlyInt8(w, None, torch.bfloat16, 64).num_bytes == 256 * 640 + 256 * 10 * 2
    # int4: half a byte a weight + a bf16 scale and zero per 32 inputs.
    assert WeightOnlyInt4(w, None, torch.bfloat16, 32).num_bytes == 256 * 320 + 256 * 20 * 4
    with pytest.raises(ValueError, match="does not divide"):
        WeightOnlyInt4(torch.randn(8, 80), None, torch.float32, 64)
    # int8 with a group size that does not divide the row falls back to one scale a row.
    assert len(WeightOnlyInt8(torch.randn(8, 80), None, torch.float32, 64).codes) == 1


def test_auto_uses_the_packing_for_the_row_count() -> None:
    w = torch.randn(64, 128)
    dense = pack_matrix(w, None, "dense", torch.float32)
    int8 = WeightOnlyInt8(w, None, torch.float32, 0)
    auto = AutoMatrix([(4, "int8", int8), (1 << 62, "dense", dense)])
    auto(torch.randn(3, 128))
    assert auto.last_format == "int8" and auto.num_bytes == int8.num_bytes
    auto(torch.randn(9, 128))
    assert auto.last_format == "dense" and auto.num_bytes == dense.num_bytes
    assert auto.resident_bytes == int8.num_bytes + dense.num_bytes


def test_knob_grammar() -> None:
    assert parse_weight_format("int8") == {"attn": "int8", "ffn": "int8", "head": "int8"}
    now = {"attn": "int8", "ffn": "int8", "head": "int8"}
    assert parse_weight_format("head=bf16", now) == {"attn": "int8", "ffn": "int8",
                                                     "head": "bf16"}
    assert format_weight_format({"attn": "int4", "ffn": "int4", "head": "int4"}) == "int4"
    assert format_weight_format({"attn": "int8", "ffn": "int4", "head": "bf16"}) == \
        "attn=int8,ffn=int4,head=bf16"
    with pytest.raises(ConfigError, match=r"weight_format must be one of dense, fp32, bf16, "
                                          r"fp16, int8, int4, auto, measured"):
        parse_weight_format("int3")
    with pytest.raises(ConfigError, match="names group 'mlp'; groups are attn, ffn, head"):
        parse_weight_format("mlp=int8")
    with pytest.raises(ConfigError, match="gives head the format 'int2'"):
        parse_weight_format("head=int2")


def test_int8_runs_its_gemm_kernel_from_the_row_count_given() -> None:
    """Both int8 kernels give the same product; which runs is the row count's rule."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 128, generator=g)
    m = WeightOnlyInt8(w, torch.randn(300, generator=g), torch.float32, 32, gemm_from_rows=4)
    m.block = 64  # several blocks, the last one short
    ran: list[tuple[str, int]] = []
    for name in ("_packed", "_gemm"):
        kernel = getattr(m, name)
        setattr(m, name, lambda x2, k=kernel, n=name: ran.append((n, len(x2))) or k(x2))
    x = torch.randn(6, 128, generator=g)
    gemm = m(x)
    packed = torch.cat([m(x[i:i + 3]) for i in (0, 3)])  # 3 rows: under the rule's 4
    if m.gemm_from_rows == 4:  # this torch has the packed kernel
        assert ran == [("_gemm", 6), ("_packed", 3), ("_packed", 3)]
    assert torch.allclose(gemm, packed, rtol=1e-5, atol=1e-5)
    assert torch.allclose(gemm, x @ m.dequantized().t() + m.bias, rtol=1e-5, atol=1e-5)


def test_the_table_times_int8_by_the_kernel_it_runs() -> None:
    """int8's time is the packed kernel's below its measured switch, gemm's from it."""
    times = {"ffn": {"fp32/fp32": {"1": 1.0, "8": 2.0, "32": 5.0},
                     "int8/fp32": {"1": 1.0, "8": 8.0, "32": 32.0},
                     "int8.gemm/fp32": {"1": 2.0, "8": 3.0, "32": 6.0}}}
    t = KernelTable(times, "fp32")
    # packed 1 + (r − 1), gemm 2 + (r − 1)/7: equal at r = 13/6, so gemm from 3 rows.
    assert t.int8_gemm_from("ffn", "fp32") == 3
    assert t.time("ffn", "int8", "fp32", 2) == 2.0
    assert t.time("ffn", "int8", "fp32", 32) == 6.0
    # Gemm's time past its last point follows its last slope (3 a 24 rows), not the rows,
    # and never goes down.
    assert t.time("ffn", "int8", "fp32", 56) == 9.0
    flat = KernelTable({"ffn": {"int8/fp32": {"1": 1.0, "8": 8.0, "32": 32.0},
                                "int8.gemm/fp32": {"1": 2.0, "8": 3.0, "32": 2.9}}}, "fp32")
    assert flat.time("ffn", "int8", "fp32", 4096) == 2.9
    # Where int8 had no packed kernel (no gemm entry), its own timings are gemm's.
    alone = KernelTable({"ffn": {"int8/fp32": {"1": 2.0, "8": 3.0, "32": 6.0}}}, "fp32")
    assert alone.time("ffn", "int8", "fp32", 56) == 9.0
    # Not timed apart (no packed kernel, or bf16 never timed): no switch; the matrix decides.
    assert t.int8_gemm_from("ffn", "bf16") == NEVER


def table() -> KernelTable:
    """A made-up measurement: int8 is fastest at one row, dense fp32 from 8 rows."""
    def row(a: float, b: float, c: float) -> dict:
        return {"1": a, "8": b, "32": c}
    times = {g: {"fp32/fp32": row(10, 12, 20), "bf16/bf16": row(6, 9, 30),
                 "int8/fp32": row(30, 200, 800), "int8/bf16": row(3, 14, 60),
                 "int4/bf16": row(2, 16, 70)} for g in ("attn", "ffn", "head")}
    return KernelTable(times, "fp32")


def test_kernel_table_rules() -> None:
    t = table()
    assert t.best_act("int8") == "bf16"
    assert t.time("attn", "int8", "bf16", 4) == pytest.approx(3 + (14 - 3) * 3 / 7)
    assert t.measured_choice() == {"attn": "int8", "ffn": "int8", "head": "int8"}
    # Linear between measured points: fp32 (10 → 12 ms) meets int8 (3 → 14 ms) at 6.4 rows,
    # int8 meets int4 (2 → 16 ms) at 3.3 rows.
    assert t.crossover("attn", "int8", "fp32") == 7
    assert t.crossover("attn", "int4", "int8") == 4
    assert t.crossover("attn", "fp32", "int8") is None  # int8 is faster from one row
    assert t.fastest("head", ("fp32", "int8"), 32) == "fp32"
    # With int8 forced to fp32 activations (30 ms at one row), bf16 weights win.
    assert t.measured_choice(lambda f: "fp32") == {g: "bf16" for g in ("attn", "ffn", "head")}
    # Within 15 %, the more accurate format listed first wins (noise is not a reason).
    t.times["ffn"]["fp32/fp32"]["1"] = 3.3
    assert t.fastest("ffn", ("fp32", "bf16", "int8"), 1, within=0.15) == "fp32"
    assert t.fastest("ffn", ("fp32", "bf16", "int8"), 1) == "int8"


def test_kernel_caches_taken_on_a_slower_machine_are_measured_again(tmp_path) -> None:
    """A table is kept only while the machine is about as fast as when it was measured: one
    taken while the reference product ran 1.5 times slower than now is measured again; one
    from a faster moment (this start is the busy one) is kept. So is the CPU's dtype."""
    assert stale(0.0, 1e-3)  # a table from before references were kept
    assert stale(2e-3, 1e-3) and not stale(1.4e-3, 1e-3) and not stale(0.5e-3, 1e-3)
    shapes, cpu = {"attn": (64, 64)}, torch.device("cpu")
    first = load_or_measure(shapes, cpu, "fp32", tmp_path)
    assert not first.cached and first.reference_s > 0
    (path,) = tmp_path.glob("*.json")
    d = json.loads(path.read_text())
    d["reference_s"] = 1e-9  # as if measured on a machine far faster than this one
    path.write_text(json.dumps(d))
    assert load_or_measure(shapes, cpu, "fp32", tmp_path).cached
    d["reference_s"] = 1e3  # as if measured while the machine crawled
    path.write_text(json.dumps(d))
    again = load_or_measure(shapes, cpu, "fp32", tmp_path)
    assert not again.cached  # measured again, and saved with this moment's reference
    assert json.loads(path.read_text())["reference_s"] == again.reference_s < 1e3
    d["reference_s"] = None  # an unreadable figure: measured again, not a failed start
    path.write_text(json.dumps(d))
    assert not load_or_measure(shapes, cpu, "fp32", tmp_path).cached
    # The CPU's compute dtype, cached beside the tables, is checked by the same rule: its
    # fp32 time is the reference product's.
    first_dtype = cpu_compute_dtype(tmp_path)
    (choice,) = tmp_path.glob("cpu-dtype-*.json")
    d = json.loads(choice.read_text())
    d["dtype"], d["seconds"]["fp32"] = "kept", 1e-9
    choice.write_text(json.dumps(d))
    assert cpu_compute_dtype(tmp_path) == "kept"
    d["seconds"]["fp32"] = 1e3
    choice.write_text(json.dumps(d))
    # Timed again, and saved. Not necessarily `first_dtype`: where bf16 runs near the gain's
    # threshold, two timings on one machine may fall either side of it.
    again_dtype, saved = cpu_compute_dtype(tmp_path), json.loads(choice.read_text())
    assert again_dtype == saved["dtype"] and first_dtype in ("bf16", "fp32")
    assert saved["seconds"]["fp32"] < 1e3
    faster = saved["seconds"]["fp32"] >= CPU_DTYPE_GAIN * saved["seconds"]["bf16"]
    assert again_dtype == ("bf16" if faster else "fp32")


@pytest.mark.parametrize("timing", ["measured", "fit"])
def test_sim_prices_weight_and_kv_formats_by_their_bytes(timing: str) -> None:
    ex = SimExecutor(SimConfig(timing=timing))
    ex.bind_kv(1000, 16, "bf16")
    base = ex.estimate_step_seconds(1, 2048, 2048)
    conv = ex.set_weight_formats(ex.resolve_weight_formats("int8"))
    per = ex.model.bytes_per_weight
    assert ex.weight_bytes == int(ex.model.matrix_weight_bytes * 1.0 / per)
    hw = ex.hardware
    saved = ex.model.matrix_weight_bytes - ex.weight_bytes
    if timing == "measured":  # along the card's measured curve, by the bytes read
        k = ex.kv_bytes_per_token("bf16")
        step = ex.estimate_step_seconds(1, 2048, 2048)
        assert step == pytest.approx(ex.measured.seconds_at(ex.weight_bytes + 2048 * k))
        assert step < base
    else:  # the fit, at the card's bandwidth
        assert ex.estimate_step_seconds(1, 2048, 2048) == pytest.approx(
            base - saved / (hw.bandwidth_bytes_per_s * hw.mbu))
    assert conv.bytes_read > conv.bytes_written and conv.seconds > 0
    mixed = ex.resolve_weight_formats("attn=int4,ffn=int8,head=dense")
    ex.set_weight_formats(mixed)
    groups = ex.model.group_bytes  # Qwen3-8B's, from its shape
    expect = sum(b / sum(groups.values()) * {"attn": 0.5, "ffn": 1.0, "head": per}[g] / per
                 for g, b in groups.items())
    assert ex.weight_bytes == int(ex.model.matrix_weight_bytes * expect)
    # KV: q8_0 reads fewer bytes per context token than bf16.
    ex.set_weight_formats(ex.resolve_weight_formats("dense"))
    before = ex.estimate_step_seconds(1, 2048, 8192)
    ex.convert_kv("q8_0", 1000, [], [])
    assert ex.estimate_step_seconds(1, 2048, 8192) < before


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_cuda_packed_matmul_equals_its_reference(fmt) -> None:
    """On CUDA int4 with bf16 activations uses `_weight_int4pack_mm`, int8 the fallback."""
    w = (torch.randn(4096, 2048) * 0.05).cuda()
    m = pack_matrix(w, None, fmt, torch.bfloat16, 128, 64)
    x = torch.randn(7, 2048, device="cuda")
    ref = x.to(torch.bfloat16).float() @ m.dequantized().float().t()
    y = m(x)
    assert (y - ref).abs().max() <= 1.5e-2 * ref.abs().max()


def test_weight_group_shares_come_from_the_model() -> None:
    """Qwen3-8B's own shares (about 20 / 72 / 8 %), not a constant: one FFN layer is 288
    MiB, so nine offloaded layers free 2,592 MiB (chapter 000)."""
    from kvdeck.runtime.planning.profiles import ModelProfile

    m = ModelProfile.load("qwen3-8b")
    shares = m.group_shares
    assert (round(shares["attn"], 2), round(shares["ffn"], 2), round(shares["head"], 2)) == \
        (0.20, 0.72, 0.08)
    assert round(m.group_bytes["ffn"] / m.num_layers / 2**20) == 288
    assert round(9 * m.group_bytes["ffn"] / m.num_layers / 2**20) == 2592


def test_weight_groups_are_read_from_a_gguf(gemma_path) -> None:
    from kvdeck.runtime.models.info import read_model_info

    info = read_model_info(gemma_path)
    groups = dict(info.group_bytes)
    # Gemma 3 ties its head to the embedding table, which is counted once, as the head.
    assert sum(groups.values()) == info.matrix_weight_bytes
    assert all(b > 0 for b in groups.values())
