"""The planner's formulas on hand-worked cases (docs/planner.md works the same numbers):
block rounding, shared-prefix arithmetic, per-format bytes, D(b, L) and the crossover batch,
expected outputs per round, step time, energy per good result; and its verdicts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.planner import Planner, Scheme
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile, user_profiles_dir
from kvdeck.runtime.planning.workloads import DraftSource, Workload, draft_sources, expected_outputs

GIB = 2**30


@pytest.fixture(scope="module")
def planner() -> Planner:
    m = ModelProfile.load("qwen3-8b")
    return Planner(HardwareProfile.load("rtx-pro-6000"), m, Workload.load("long-burst"),
                   12 * GIB, 7.0, draft_sources(m))


def test_kv_bytes_per_token_per_format(planner: Planner) -> None:
    # 2 (K, V) × 36 layers × 8 KV heads × a row of 128 values.
    assert planner.kv_bytes_per_token("bf16") == 2 * 36 * 8 * 128 * 2 == 147_456
    assert planner.kv_bytes_per_token("q8_0") == 2 * 36 * 8 * (4 * 34) == 78_336  # 34 B / 32
    assert planner.kv_bytes_per_token("q4_0") == 2 * 36 * 8 * (4 * 18) == 41_472  # 18 B / 32


def test_block_rounding(planner: Planner) -> None:
    assert planner.blocks(8192) == 512
    # After 256 outputs a request holds 8192 + 255 positions: 527.9 blocks, so 528.
    assert planner.final_tokens == 8447 and planner.blocks(8447) == 528
    assert planner.seq_bytes(8447, "bf16") == 528 * 16 * 147_456
    assert planner.shared_blocks == 6144 // 16 == 384


def test_shared_prefix_arithmetic(planner: Planner) -> None:
    one = 528 * 16 * 147_456  # 1,245,708,288 B
    assert planner.kv_for(16, "bf16", False) == 16 * one
    # The prefix's 384 full blocks are held once: 15 requests save 6144 tokens each.
    assert planner.kv_for(16, "bf16", True) == 16 * one - 15 * 6144 * 147_456 \
        == 6_341_787_648
    assert planner.capacity("bf16", False) == 10  # 12 GiB / 1.16 GiB
    # 1 + (12 GiB − one) // (one − 6144·k) = 1 + 11,639,193,600 // 339,738,624
    assert planner.capacity("bf16", True) == 1 + (12 * GIB - one) // (one - 6144 * 147_456)


def test_reads_per_decode_step_and_the_crossover_batch(planner: Planner) -> None:
    d_w = 15_136_811_008
    assert planner.read_bytes(16, 8320) == d_w + 16 * 8320 * 147_456 == 34_766_153_728
    assert planner.crossover_batch(8320) == math.ceil(d_w / (8320 * 147_456)) == 13
    assert planner.read_bytes(12, 8320) < 2 * d_w <= planner.read_bytes(13, 8320)


def test_step_time_by_the_fit_and_by_the_roofline(planner: Planner) -> None:
    # 26.22 ms + 16 rows × 30.4 µs + 3 ns × 16 × 8,321 causal pairs.
    assert planner.decode_step(16, 8320, timing="fit") == pytest.approx(
        0.02622 + 16 * 30.4e-6 + 3e-9 * 16 * 8321)
    # Decode is memory-bound: D(b, L) at 1.792 TB/s × MBU 0.65.
    assert planner.decode_step(16, 8320, timing="roofline") == pytest.approx(
        (15_136_811_008 + 16 * 8321 * 147_456) / (1.792e12 * 0.65))


def test_measured_decode_steps_are_interpolated(planner: Planner) -> None:
    # A CPU-like profile: flat from 1 to 4 rows, steep to 16; 100 → 120 ms over the context.
    points = tuple((b, c, s + 0.02 * (c == 1024)) for b, s in ((1, 0.10), (4, 0.11), (16, 0.27))
                   for c in (128, 1024))
    model = replace(planner.model, decode_times={"rtx-pro-6000": points})
    assert model.decode_seconds("rtx-pro-6000", 4, 128) == pytest.approx(0.11)
    assert model.decode_seconds("rtx-pro-6000", 4, 576) == pytest.approx(0.12)  # mid-context
    assert model.decode_seconds("rtx-pro-6000", 10, 128) == pytest.approx(0.19)  # mid-batch
    assert model.decode_seconds("rtx-pro-6000", 1, 1920) is None  # past the measured contexts
    assert model.decode_seconds("rtx-pro-6000", 32, 128) is None  # beyond: the fit decides
    assert model.decode_seconds("h200", 4, 128) is None
    p = Planner(planner.hw, model, planner.workload, 12 * GIB, 7.0)
    assert p.decode_step(4, 128, "bf16") == pytest.approx(0.11)
    assert p.decode_step(4, 128, "bf16", timing="fit") == pytest.approx(0.11)
    # Past the measured batches the fit decides under `fit`, the measured curve under
    # `measured` (it carries on from its last segment: never cheaper than 16 rows).
    assert p.decode_step(32, 128, timing="fit") == pytest.approx(
        planner.decode_step(32, 128, timing="fit"))
    assert p.decode_step(32, 128) >= p.decode_step(16, 128) == pytest.approx(0.27)


def test_expected_outputs_per_round() -> None:
    assert expected_outputs((0.8, 0.5)) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert expected_outputs(()) == 1.0
    d = DraftSource("d", "", "*", "parallel", 3, 0, 0, 0.0, 0.0, (1.0, 1.0, 1.0))
    assert d.expected_outputs() == 4.0 and d.expected_outputs(1) == 2.0


def test_sliding_window_layers_count_as_the_window() -> None:
    gemma = ModelProfile.from_gguf("gemma3-270m")  # generated from the GGUF's header
    assert (gemma.num_layers, gemma.num_local_layers, gemma.sliding_window) == (18, 15, 512)
    per_layer_token = 2 * 1 * 256 * 2
    # 3 global layers × 512 blocks + 15 local layers × (512/16 + 1) blocks, 16 tokens each.
    assert gemma.kv_bytes(8192, 16) == per_layer_token * 16 * (3 * 512 + 15 * 33)
    assert gemma.kv_bytes(100, 16) == per_layer_token * 16 * 18 * 7  # inside the window


def test_burst_energy_and_accelerator_time_per_good_result(planner: Planner) -> None:
    dflash = next(d for d in planner.drafts if d.name == "dflash-qwen3-8b")
    r = planner.evaluate(Scheme(shared=True, draft=dflash))
    assert r.feasible and r.good == 16
    assert r.accelerator_s_per_good == pytest.approx(r.completion_s / 16)
    assert r.energy_j_per_good == pytest.approx(r.completion_s / 16 * 600)
    # A scheme that misses the deadline has no good results: its cost per good is infinite.
    assert math.isinf(planner.evaluate(Scheme()).energy_j_per_good)


def test_the_reference_burst_plan(planner: Planner) -> None:
    plan = planner.plan()
    by_name = {r.scheme.name: r for r in plan.results}
    base = by_name["baseline"]
    assert {b.limit for b in base.broken} == {"memory", "deadline"}
    assert base.memory_bytes == 16 * 528 * 16 * 147_456
    assert by_name["shared prefix"].broken[0].limit == "deadline"
    assert plan.choice is not None and plan.choice.feasible and not plan.choice.unpriced
    assert all(plan.choice.accelerator_s_per_good <= r.accelerator_s_per_good
               for r in plan.results if not r.unpriced)
    # The chapter's answer: only speculation on the shared prefix meets 7 s; a KV format
    # alone moves a step along the measured curve by a fraction of a millisecond.
    assert plan.choice.scheme.name == "shared prefix + spec dflash-qwen3-8b"
    assert by_name["shared prefix + q8_0 KV"].broken[0].limit == "deadline"
    # Fully priced schemes are chosen over ones whose format conversion was not measured.
    cheaper = by_name["shared prefix + q4_0 KV + spec dflash-qwen3-8b"]
    assert cheaper.feasible and cheaper.unpriced.startswith("q4_0 conversion")
    assert cheaper.completion_s < plan.choice.completion_s
    assert "feasible before q4_0 conversion" in cheaper.verdict()
    assert any(r.scheme.offload for r in plan.results)  # over-budget schemes retried offloaded


def test_nothing_feasible_says_what_would_help(planner: Planner) -> None:
    tight = Planner(planner.hw, planner.model, planner.workload, 1 * GIB, 3.0, planner.drafts)
    plan = tight.plan()
    assert plan.choice is None and plan.suggestions
    text = " ".join(plan.suggestions)
    assert "deadline of" in text and "Outputs of at most" in text


def test_poisson_arrivals_follow_littles_law(planner: Planner) -> None:
    chat = Workload.load("short-chat")
    slow, fast = (Planner(planner.hw, planner.model, replace(chat, rate_per_s=r), 40 * GIB,
                          7.0).evaluate(Scheme()) for r in (1.0, 4.0))
    assert slow.concurrency < fast.concurrency
    assert slow.concurrency == pytest.approx(1.0 * slow.completion_s, abs=1.5)
    flood = Planner(planner.hw, planner.model, replace(chat, rate_per_s=500.0), 40 * GIB,
                    7.0).evaluate(Scheme())
    assert math.isinf(flood.completion_s) and flood.broken[-1].limit == "deadline"


def test_poisson_overload_suggests_the_rate_that_holds(planner: Planner) -> None:
    flood = replace(Workload.load("short-chat"), rate_per_s=40.0)
    tight = Planner(planner.hw, planner.model, flood, 12 * GIB, 7.0)
    plan = tight.plan()
    assert plan.choice is None
    line = next(s for s in plan.suggestions if s.startswith("Arrivals of at most"))
    rate = float(line.split()[4])
    assert 1 < rate < 40
    ok = Planner(planner.hw, planner.model, replace(flood, rate_per_s=rate * 0.99), 12 * GIB,
                 7.0).plan()
    assert ok.choice is not None


@pytest.mark.parametrize("kind, body, message", [
    ("models", 'num_layers = 2\nnum_heads = 2\nnum_kv_heads = 1\nhead_dim = 8\n'
               'weight_bytes = 1\nmatrix_weight_bytes = 1\ncontext_length = 8\n'
               '[decode.x]\npoints = [[1, 2]]\n',
     ": decode.x.points must be a list of [batch, context, milliseconds] triples of positive "
     "numbers, got [[1, 2]]."),
    ("workloads", 'prompt_tokens = 10\noutput_tokens = 5\n',
     "lacks the required key 'deadline_s'."),
    ("workloads", 'prompt_tokens = 10\noutput_tokens = -5\ndeadline_s = 1\n',
     ": output_tokens must be greater than 0, got -5."),
    ("workloads", 'prompt_tokens = inf\noutput_tokens = 5\ndeadline_s = 1\n',
     ": prompt_tokens must be a finite number, got inf."),
    ("workloads", 'prompt_tokens = 10\noutput_tokens = 5\ndeadline_s = nan\n',
     ": deadline_s must be a finite number, got nan."),
    ("workloads", 'prompt_tokens = 10\noutput_tokens = 5\ndeadline_s = 1\n'
                  'num_requests = 1000000\n',
     ": num_requests must be at most 100000, got 1000000."),
    ("workloads", 'prompt_tokens = 10\noutput_tokens = 5\ndeadline_s = 1\n'
                  'shared_prefix_tokens = 20\n',
     ": shared_prefix_tokens must be at most prompt_tokens (10), got 20."),
    ("workloads", 'prompt_tokens = 10\noutput_tokens = 5\ndeadline_s = 1\narrival = "x"\n',
     ": arrival must be one of burst, poisson, got 'x'."),
    ("drafts", 'draft_length = 3\nacceptance = [0.5, 2]\n',
     ": acceptance must be a list of at least draft_length (3) chances from 0 to 1 (or give a "
     "measured tokens_per_round), got [0.5, 2]."),
    ("models", 'num_layers = 2\nnum_heads = 2\nnum_kv_heads = 1\nhead_dim = 8\n'
               'weight_bytes = 1\nmatrix_weight_bytes = 1\ncontext_length = 0\n',
     ": context_length must be greater than 0, got 0."),
])
def test_a_bad_profile_names_the_file_the_field_and_the_problem(kind, body, message,
                                                                monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    path = user_profiles_dir() / kind / "broken.toml"
    path.parent.mkdir(parents=True)
    path.write_text(body)
    load = {"workloads": Workload.load, "drafts": DraftSource.load,
            "models": ModelProfile.load}[kind]
    with pytest.raises(ConfigError) as e:
        load("broken")
    assert str(e.value).startswith(f"Profile {path}") and str(e.value).endswith(message)


def test_unknown_profiles_list_the_known_ones(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))  # only the shipped profiles
    with pytest.raises(ConfigError, match=r"^Unknown workloads profile 'nope'; available: "
                                          r"long-burst, long-context, short-chat"):
        Workload.load("nope")
    with pytest.raises(ConfigError, match=r"^Unknown model profile 'nope'; available: "
                                          r"llama-70b, qwen3-235b-a22b, qwen3-8b, or a model "
                                          r"name or GGUF path"):
        ModelProfile.load("nope")
