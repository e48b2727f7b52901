"""Switching the KV format while requests run: the pool is re-encoded between iterations,
its block count follows the budget, running requests keep their KV, cached prefixes stay
under the new format's namespace, and replay rebuilds every step of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.kv_codecs import fp8_supported
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.kv.events import Relayout
from kvdeck.runtime.runs.recording import read_run, record_headless
from kvdeck.runtime.runs.replay import Replay
from kvdeck.runtime.runs.trace import synthesize_tokens
from tests.factories import TinySpec, write_tiny_gguf
from tests.integration.test_engine_sim import drive, view_of, workload

KNOBS = Knobs(max_num_batched_tokens=512, chunk_size=128, max_num_seqs=16)
BLOCK = 8


def sim_engine(blocks_at_fp16: int = 60) -> Engine:
    ex = SimExecutor(SimConfig(eos_probability=0.02), seed=7)
    budget = blocks_at_fp16 * BLOCK * ex.kv_bytes_per_token("fp16")
    return Engine(EngineConfig(block_size=BLOCK, kv_memory_bytes=budget, seed=7, knobs=KNOBS),
                  ex)


def test_switching_formats_mid_run_keeps_requests_resizes_the_pool_and_replays(
        tmp_path: Path) -> None:
    e = sim_engine()
    rec = record_headless(e, tmp_path)
    for i, a in enumerate(workload()):
        e.add_request(synthesize_tokens(a, i, 32_000), SamplingParams(max_tokens=a.output_len),
                      request_id=f"r{i}", arrival_time=a.arrival_s)
    live: list[dict] = []
    budget = e.config.kv_memory_bytes
    seen = []
    for fmt in ("q4_0", "fp32", "q8_0", "fp8_e4m3", "fp16"):
        drive(e, 12, live)
        running = {r.request_id for r in e.scheduler.running}
        nodes = e.kv.tree.num_nodes
        e.set_knobs(kv_format=fmt)
        drive(e, 1, live)
        sw = e.switcher.recent[-1]
        seen.append(sw)
        assert sw.new == fmt and e.switcher.kv_format == fmt
        bpt = e.executor.kv_bytes_per_token(fmt)
        assert e.kv.num_blocks == sw.num_blocks == budget // (BLOCK * bpt)
        assert e.kv.bytes_per_block == BLOCK * bpt
        assert e.kv.namespace.split("|")[1] == fmt
        still = {r.request_id for r in e.scheduler.running} | \
            {r.request_id for r in e.scheduler.waiting} | {r.request_id for r in e.completed}
        assert running <= still  # nobody lost: running, preempted back to waiting, or done
        if not sw.dropped and not sw.preempted:
            assert e.kv.tree.num_nodes >= nodes - 1  # the cache survived the conversion
    drive(e, 100_000, live)
    rec.close()
    e.check_integrity()
    # Capacity moves by the formats' byte ratio: q4_0 holds 64/18 as many blocks as fp16.
    assert seen[0].num_blocks == 60 * 64 // 18
    assert seen[1].num_blocks == 30
    shrink = seen[1]
    assert shrink.preempted or shrink.dropped  # fp32 halves the pool: room was made
    assert {r.status for r in e.completed} <= {RequestStatus.FINISHED_STOPPED,
                                                RequestStatus.FINISHED_LENGTH,
                                                RequestStatus.REJECTED}
    assert len(e.completed) == 40
    # Replay rebuilds every step, block map size included, from the records alone.
    replay = Replay(*read_run(tmp_path))
    state = replay.initial_state()
    assert len(replay.steps) == len(live)
    relayouts = 0
    for step, (record, expected) in enumerate(zip(replay.steps, live, strict=True)):
        state.apply(record)
        state.check_integrity()
        relayouts += sum(isinstance(ev, Relayout) for ev in record.kv)
        got = view_of(state.snapshot())
        for key in expected:
            assert got[key] == expected[key], f"{key} differs after record {step}"
    assert relayouts == 5
    assert [sw.new for sw in state.snapshot().switches] == \
        ["q4_0", "fp32", "q8_0", "fp8_e4m3", "fp16"]
    assert state.snapshot().kv.kv_format == "fp16"


def test_a_format_the_executor_cannot_store_is_refused_at_submission() -> None:
    e = sim_engine()
    with pytest.raises(ConfigError, match="kv_format must be one of"):
        e.set_knobs(kv_format="int3")
    assert e.submitted_knobs.kv_format == "fp16"


# -- the torch executor ------------------------------------------------------------------------

SPEC = TinySpec(arch="llama", head_dim=32, num_heads=2, num_kv_heads=1, hidden=64)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5 + (i * 7 + j) % 80 for j in range(n)] for i, n in enumerate((30, 45, 22, 37))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama32.gguf", SPEC)


def torch_engine(path: Path, fmt: str, blocks_at_fp16: int = 64) -> Engine:
    ex = TorchExecutor(path, device="cpu", dtype="fp32")
    budget = blocks_at_fp16 * 4 * ex.kv_bytes_per_token("fp16")
    return Engine(EngineConfig(block_size=4, kv_memory_bytes=budget,
                               knobs=Knobs(kv_format=fmt, max_num_batched_tokens=64,
                                           chunk_size=16)), ex)


def run_waves(e: Engine, switch_to: str | None, at_step: int = 6) -> dict[str, list[int]]:
    """A first wave that finishes (so the free list hands the second wave high block ids),
    then a second wave, switching format a few steps into it."""
    for i, p in enumerate(PROMPTS):
        e.add_request(p, GREEDY, request_id=f"w1-{i}")
    e.run_until_idle()
    for i, p in enumerate(PROMPTS):
        e.add_request(list(reversed(p)), GREEDY, request_id=f"w2-{i}")
    for _ in range(at_step):
        e.step()
        e.check_integrity()
    if switch_to is not None:
        assert len(e.scheduler.running) == 4
        e.set_knobs(kv_format=switch_to)
    while e.has_work:
        e.step()
        e.check_integrity()
    return {r.request_id: list(r.output_token_ids) for r in e.completed}


def test_widening_fp16_to_fp32_mid_run_changes_no_token_and_moves_blocks(tiny: Path) -> None:
    plain = run_waves(torch_engine(tiny, "fp16", 128), None)
    e = torch_engine(tiny, "fp16", 128)
    switched = run_waves(e, "fp32")
    # fp16 values are exact in fp32: every token after the conversion is the same.
    assert switched == plain
    sw = e.switcher.recent[-1]
    assert (sw.old, sw.new, sw.num_blocks) == ("fp16", "fp32", 64)
    assert sw.blocks > 0 and sw.measured and sw.bytes > 0 and not sw.preempted
    assert e.executor.kv.num_blocks == 64 and e.executor.kv.codec.name == "fp32"
    assert sw.moved > 0  # blocks past the smaller pool's end were moved, data and all


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "bf16", pytest.param(
    "fp8_e4m3", marks=pytest.mark.skipif(not fp8_supported(torch.device("cpu")),
                                         reason="this torch has no float8 on the CPU"))])
def test_quantizing_mid_run_keeps_every_request_alive(tiny: Path, fmt: str) -> None:
    e = torch_engine(tiny, "fp32", blocks_at_fp16=128)
    assert e.kv.num_blocks == 64
    out = run_waves(e, fmt)
    assert len(out) == 8 and all(len(toks) == 24 for toks in out.values())
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in e.completed)
    sw = e.switcher.recent[-1]
    # The pool's block count grows by the format's byte ratio against fp32 (4 bytes/value).
    per_value = {"q8_0": 34 / 32, "q4_0": 18 / 32, "bf16": 2, "fp8_e4m3": 1}[fmt]
    assert sw.num_blocks == e.kv.num_blocks == int(64 * 4 / per_value)
    pool = e.executor.kv
    assert pool.num_bytes == pool.num_blocks * 4 * e.executor.kv_bytes_per_token(fmt)


@pytest.mark.cuda
def test_cuda_switch_keeps_tokens(tiny: Path) -> None:
    def engine(fmt: str) -> Engine:
        ex = TorchExecutor(tiny, device="cuda", dtype="fp32")
        return Engine(EngineConfig(block_size=4, num_blocks=64, knobs=Knobs(kv_format=fmt)),
                      ex)
    assert run_waves(engine("fp16"), "fp32") == run_waves(engine("fp16"), None)


def test_dtype_int8_keeps_its_matrices_and_refuses_other_weight_formats(tiny: Path) -> None:
    ex = TorchExecutor(tiny, device="cpu", dtype="int8")
    e = Engine(EngineConfig(num_blocks=32, knobs=Knobs(weight_format="measured")), ex)
    assert e.config.knobs.weight_format == "dense"
    with pytest.raises(ConfigError, match=r"dtype int8 already quantizes matrices \(FBGEMM "
                                          r"dynamic int8\); other weight formats need a float"):
        e.set_knobs(weight_format="int4")
    assert e.submitted_knobs.weight_format == "dense"


def test_weight_format_switch_mid_run_is_recorded_and_replayed(tiny: Path, tmp_path) -> None:
    ex = TorchExecutor(tiny, device="cpu", dtype="fp32", kernel_cache=tmp_path / "k")
    e = Engine(EngineConfig(block_size=4, num_blocks=96, knobs=Knobs(
        max_num_batched_tokens=64, chunk_size=16)), ex)
    rec = record_headless(e, tmp_path / "run")
    for i, p in enumerate(PROMPTS):
        e.add_request(p, GREEDY, request_id=f"r{i}")
    for _ in range(4):
        e.step()
    before = ex.resident_weight_bytes
    e.set_knobs(weight_format="head=int4")
    e.step()
    e.set_knobs(weight_format="auto")
    e.run_until_idle()
    rec.close()
    e.check_integrity()
    assert all(len(r.output_token_ids) == 24 for r in e.completed)
    first, second = [sw for sw in e.switcher.recent if sw.knob == "weight_format"]
    assert first.new == "attn=dense,ffn=dense,head=int4"
    assert first.bytes_before == before and first.bytes < before
    assert second.new == "auto" and ex.auto_choice()
    replay = Replay(*read_run(tmp_path / "run"))
    state = replay.initial_state()
    for record in replay.steps:
        state.apply(record)
    assert [sw.new for sw in state.snapshot().switches] == [first.new, "auto"]
    assert state.snapshot().knobs.weight_format == "auto"
