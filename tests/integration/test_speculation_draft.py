"""Speculative decoding with a draft model on tiny models, with the torch executor
(`runtime/spec/draft_model.py`, twin KV blocks) and the llama_cpp executor
(`runtime/executors/llama_cpp_draft.py`, a context of its own): lossless greedy output
inside a mixed batch; a draft identical to the target has every
greedy draft accepted — through prefix-cache hits, preemption, copy-on-write and rollback,
so the draft's twin KV is right after each of them; no block leaks under random stops and
aborts; seeded sampling reproducible; the pool sized from target + draft bytes; a draft
with another vocabulary, or `draft` without a draft model, refused with a sentence. The
sim's modelled draft: sequential drafting costs more than parallel, and a run with it
replays record for record."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.core.step_data import ScheduledChunk, SchedulerOutput
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.runs.recording import read_run, record_headless
from kvdeck.runtime.runs.replay import Replay
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.factories import TinySpec, write_tiny_gguf
from tests.integration.test_engine_sim import drive, view_of
from tests.integration.test_speculation import run, stop_and_abort_storm

TARGET = TinySpec(arch="llama", head_dim=32, num_heads=2, num_kv_heads=1, hidden=64, vocab=64)
DRAFT = TinySpec(arch="llama", num_layers=1, head_dim=16, num_heads=2, num_kv_heads=1,
                 hidden=32, ffn=64, vocab=64, seed=3)
PROMPTS = [[3 + (j * (i + 2)) % 50 for j in range(20 + 7 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("draft")
    return write_tiny_gguf(d / "target.gguf", TARGET), write_tiny_gguf(d / "draft.gguf", DRAFT)


EXECUTORS = ["torch", "llama_cpp"]


def engine(target: Path, draft: Path | None, method: str, num_blocks: int = 200,
           executor: str = "torch", **knobs) -> Engine:
    """llama_cpp: 4 slots, each a quarter of the pool's tokens, decoding batch-invariant
    (its batched rows would otherwise differ from plain decoding by themselves)."""
    if executor == "torch":
        ex = TorchExecutor(target, device="cpu", dtype="fp32", weight_activations="fp32",
                           draft_model=draft)
    else:
        from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

        ex = LlamaCppExecutor(target, threads=2, n_parallel=4, batch_invariant=True,
                              draft_model=draft)
        knobs.setdefault("max_num_seqs", 4)
    return Engine(EngineConfig(block_size=4, num_blocks=num_blocks, knobs=Knobs(
        speculative_method=method, max_num_batched_tokens=96, chunk_size=32,
        weight_format="dense", **knobs)), ex)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_draft_model_greedy_is_lossless_in_a_mixed_batch(models, executor) -> None:
    target, draft = models
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    requests = [(f"r{i}", p, greedy if i % 2 == 0 else plain) for i, p in enumerate(PROMPTS)]
    expected = run(engine(target, None, "off", executor=executor), requests)
    e = engine(target, draft, "draft", executor=executor, draft_length="fixed")
    assert run(e, requests) == expected
    stats = e.scheduler.spec
    # Fixed length: 4 positions a round, fewer only where max_tokens leaves less room.
    assert stats.num_drafts > 10
    assert 3 * stats.num_drafts < stats.num_draft_tokens <= 4 * stats.num_drafts
    assert stats.draft_seconds > 0 and stats.draft_step_seconds > stats.draft_seconds
    view = snapshot_of(e).speculation
    assert view.draft_model == "tiny-llama" and view.drafts == stats.num_drafts


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_draft_equal_to_the_target_is_always_accepted_through_hits_and_preemption(
        models, executor) -> None:
    """The draft's KV must be exactly the target's computation for every position it
    keeps: after prefix-cache hits (a shared prompt), preemption in a small pool, and
    rollback. A wrong twin block (torch) or draft stream (llama_cpp: copied from a holder
    slot with the target's, cut on rollback, cleared with a reused slot) would show as a
    rejected draft. llama.cpp's slots always fit their requests, so it never preempts."""
    target, _ = models
    shared = PROMPTS[3][:16]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = [(f"s{i}", shared + [5 + i, 7 + i], greedy) for i in range(6)]
    blocks = 40 if executor == "torch" else 64
    expected = run(engine(target, None, "off", num_blocks=blocks, executor=executor),
                   requests)
    e = engine(target, target, "draft", num_blocks=blocks, executor=executor,
               draft_length="fixed", num_speculative_tokens=3)
    assert run(e, requests) == expected
    assert e.kv.tree.num_hit_tokens > 0
    assert e.scheduler.num_preemptions > 0 or executor == "llama_cpp"
    stats = e.scheduler.spec
    assert stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("executor", EXECUTORS)
def test_draft_rollback_leaks_nothing_under_stops_and_aborts(models, executor) -> None:
    target, draft = models
    e = engine(target, draft, "draft", num_blocks=60, executor=executor,
               num_speculative_tokens=5)
    stop_and_abort_storm(e, PROMPTS, 3, (0.0, 0.8))
    if executor == "torch":
        assert not e.executor.draft.done  # per-request draft progress is forgotten
    else:
        assert not e.executor._running and not e.executor._seq_of  # every slot retired


@pytest.mark.parametrize("executor", EXECUTORS)
def test_seeded_sampling_with_a_draft_model_is_reproducible(models, executor) -> None:
    target, draft = models
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=24, seed=5, ignore_eos=True)
    requests = [(f"s{i}", p, sp) for i, p in enumerate(PROMPTS)]
    first = run(engine(target, draft, "draft", executor=executor), requests)
    assert run(engine(target, draft, "draft", executor=executor), requests) == first
    assert all(len(t) == 24 for t in first.values())


def test_the_pool_holds_target_and_draft_kv(models) -> None:
    target, draft = models
    ex = TorchExecutor(target, device="cpu", dtype="fp32", draft_model=draft)
    budget = 1 << 20
    e = Engine(EngineConfig(block_size=4, kv_memory_bytes=budget), ex)
    kt, kd = ex.kv_bytes_per_token("fp16"), ex.draft_kv_bytes_per_token("fp16")
    assert kd == 2 * DRAFT.num_layers * DRAFT.num_kv_heads * DRAFT.head_dim * 2
    assert e.kv.num_blocks == budget // (4 * (kt + kd))
    view = snapshot_of(e).kv
    assert view.draft_bytes_per_block == 4 * kd and view.bytes_per_block == 4 * kt
    assert ex.draft.kv.num_blocks == e.kv.num_blocks


def test_llama_cpp_pool_holds_target_and_draft_kv_and_refuses_another_vocabulary(
        models, tmp_path) -> None:
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    target, draft = models
    ex = LlamaCppExecutor(target, threads=2, n_parallel=4, draft_model=draft)
    budget = 1 << 20
    e = Engine(EngineConfig(block_size=4, kv_memory_bytes=budget,
                            knobs=Knobs(max_num_seqs=4, weight_format="dense")), ex)
    kt, kd = ex.kv_bytes_per_token("fp16"), ex.draft_kv_bytes_per_token("fp16")
    assert kd == 2 * DRAFT.num_layers * DRAFT.num_kv_heads * DRAFT.head_dim * 2
    assert e.kv.num_blocks == budget // (4 * (kt + kd))
    assert snapshot_of(e).kv.draft_bytes_per_block == 4 * kd
    assert ex.draft.ctx is not None and snapshot_of(e).speculation.draft_model == "tiny-llama"
    e.close()
    other = write_tiny_gguf(tmp_path / "other.gguf", TinySpec(vocab=96))
    with pytest.raises(ConfigError, match=r"^The draft model tiny-llama \(other.gguf\) and the "
                       r"target tiny-llama \(target.gguf\) have different vocabularies "
                       r"\(96 tokens against 64\); a draft model must share"):
        LlamaCppExecutor(target, draft_model=other)


def test_mismatched_vocabularies_and_a_missing_draft_are_refused(models, tmp_path) -> None:
    target, _ = models
    other = write_tiny_gguf(tmp_path / "other.gguf", TinySpec(vocab=96))
    with pytest.raises(ConfigError, match=r"^The draft model tiny-llama \(other.gguf\) and the "
                       r"target tiny-llama \(target.gguf\) have different vocabularies "
                       r"\(96 tokens against 64\); a draft model must share"):
        TorchExecutor(target, device="cpu", draft_model=other)
    e = engine(target, None, "off")
    with pytest.raises(ConfigError, match="speculative_method draft needs a draft model; "
                                          "start with --draft-model"):
        e.set_knobs(speculative_method="draft")


def _sim_draft_seconds(drafting: str, k: int) -> float:
    ex = SimExecutor(SimConfig(draft_cost=0.1, drafting=drafting))
    plan = SchedulerOutput(step=1, time=0.0, speculative_method="draft")
    for i in range(8):
        req = Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=50))
        req.num_computed_tokens = 99
        plan.chunks.append(ScheduledChunk(req, 1 + k, 99, list(range(7)), True, (), k))
    return ex._draft_seconds(plan)


def test_sim_sequential_drafting_costs_a_pass_per_position() -> None:
    one = _sim_draft_seconds("sequential", 1)
    assert _sim_draft_seconds("sequential", 4) == pytest.approx(4 * one, rel=0.05)
    # One pass for all positions: on the fitted model, the fixed cost is paid once.
    assert _sim_draft_seconds("parallel", 4) < 1.2 * one


def test_sim_draft_model_what_if_is_recorded_and_replayed(tmp_path: Path) -> None:
    ex = SimExecutor(SimConfig(eos_probability=0.02, spec_acceptance_profile="0.9,0.7,0.5",
                               draft_cost=0.15, draft_kv_ratio=0.25), seed=3)
    e = Engine(EngineConfig(block_size=8, kv_memory_bytes=2 << 30, seed=3, knobs=Knobs(
        max_num_batched_tokens=512, chunk_size=128, speculative_method="draft",
        num_speculative_tokens=3, draft_length="fixed")), ex)
    assert e.kv.num_blocks == (2 << 30) // (8 * round(1.25 * ex.kv_bytes_per_token("fp16")))
    rec = record_headless(e, tmp_path)
    for i in range(12):
        e.add_request(list(range(5 + i, 70 + i)), SamplingParams(max_tokens=30),
                      request_id=f"r{i}", arrival_time=0.01 * i)
    live: list[dict] = []
    drive(e, 100_000, live)
    rec.close()
    stats = e.scheduler.spec
    rates = stats.per_position()
    assert rates[0] > rates[1] > rates[2]  # the profile, position by position
    assert stats.draft_seconds > 0
    replay = Replay(*read_run(tmp_path))
    state = replay.initial_state()
    for record, expected in zip(replay.steps, live, strict=True):
        state.apply(record)
        assert view_of(state.snapshot()) == expected
    assert state.snapshot().speculation == snapshot_of(e).speculation
    assert state.snapshot().kv.draft_bytes_per_block == snapshot_of(e).kv.draft_bytes_per_block


def test_sim_draft_settings_without_a_draft_are_refused() -> None:
    from kvdeck.runtime.settings import resolve

    with pytest.raises(ConfigError, match="give it a cost with --draft-cost C too"):
        SimConfig(drafting="parallel")
    with pytest.raises(ConfigError, match=r"^spec_acceptance_profile must be comma-separated "
                       r"chances from 0 to 1, like 0.9,0.8,0.7; got '0.9,x'.$"):
        SimConfig(spec_acceptance_profile="0.9,x")
    with pytest.raises(ConfigError, match=r"^--draft-model loads a real draft model \(torch "
                       r"and llama_cpp executors\); the sim models one with --draft-cost "
                       r"and --drafting.$"):
        resolve({"executor": "sim", "draft_model": "qwen2.5-coder-0.5b"})
    e = Engine(EngineConfig(num_blocks=64), SimExecutor(SimConfig()))
    with pytest.raises(ConfigError, match="needs a draft model; start with --draft-cost C"):
        e.set_knobs(speculative_method="draft")
