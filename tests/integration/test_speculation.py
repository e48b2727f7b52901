"""Speculative decoding in the engine: lossless (greedy output token for token the same as
without it, inside a batch with requests that do not speculate), KV rolled back after every
rejection with integrity intact, no block leaked under random stops and aborts, seeded
sampling reproducible, and the sim's what-ifs recorded and replayed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.runs.recording import read_run, record_headless
from kvdeck.runtime.runs.replay import Replay
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.factories import TinySpec, write_tiny_gguf
from tests.integration.test_engine_sim import drive, view_of

SPEC = TinySpec(arch="llama", head_dim=32, num_heads=2, num_kv_heads=1, hidden=64, vocab=64)
# Prompts that repeat themselves, as code edits and quoting do: n-gram lookup finds drafts.
PROMPTS = [[3 + (j % (5 + i)) for j in range(24 + 6 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama-spec.gguf", SPEC)


def engine(path: Path, method: str, num_blocks: int = 200, **knobs) -> Engine:
    ex = TorchExecutor(path, device="cpu", dtype="fp32", weight_activations="fp32")
    return Engine(EngineConfig(block_size=4, num_blocks=num_blocks, knobs=Knobs(
        speculative_method=method, max_num_batched_tokens=96, chunk_size=32,
        weight_format="dense", **knobs)), ex)


def run(e: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    for rid, prompt, sp in requests:
        e.add_request(prompt, sp, request_id=rid)
    while e.has_work:
        e.step()
        e.check_integrity()
    return {r.request_id: list(r.output_token_ids) for r in e.completed}


def test_greedy_speculation_is_token_for_token_lossless_in_a_mixed_batch(tiny: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # Requests asking for logprobs decode one token a step: they share the batch unspeculated.
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    requests = [(f"r{i}", p, greedy if i % 2 == 0 else plain) for i, p in enumerate(PROMPTS)]
    expected = run(engine(tiny, "off"), requests)
    e = engine(tiny, "ngram", draft_length="fixed")  # counts below must not follow timing
    assert run(e, requests) == expected
    stats = e.scheduler.spec
    assert stats.num_drafts > 10 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.mean_accepted_length > 1.0  # verify passes bought more than one token each
    view = snapshot_of(e).speculation
    assert view.method == "ngram" and view.drafts == stats.num_drafts
    # A token at position i + 1 is kept only if the one at i was: counts never increase.
    counts = view.accepted_per_pos
    assert all(a >= b for a, b in zip(counts, counts[1:], strict=False)) and counts[0] > 0
    assert all(0.0 <= rate <= 1.0 for rate in view.per_position)


@pytest.mark.parametrize("length", ["adaptive", "fixed"])
def test_fewer_steps_with_speculation(tiny: Path, length: str) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    requests = [("a", PROMPTS[3], greedy)]
    off = engine(tiny, "off")
    on = engine(tiny, "ngram", num_speculative_tokens=6, draft_length=length)
    assert run(off, requests) == run(on, requests)
    assert on.step_count < off.step_count


def test_seeded_sampling_with_speculation_is_reproducible(tiny: Path) -> None:
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=11, ignore_eos=True)
    requests = [(f"s{i}", p, sp) for i, p in enumerate(PROMPTS)]
    first = run(engine(tiny, "ngram"), requests)
    assert run(engine(tiny, "ngram"), requests) == first
    assert all(len(t) == 32 for t in first.values())


def run_with_aborts(e: Engine, rng: random.Random, every: int) -> None:
    """Step until idle, checking integrity after every step and aborting a random running
    request every `every` steps."""
    steps = 0
    while e.has_work:
        e.step()
        e.check_integrity()
        steps += 1
        if steps % every == 0 and e.scheduler.running:
            e.abort(rng.choice(e.scheduler.running).request_id)


def stop_and_abort_storm(e: Engine, prompts: list[list[int]], seed: int,
                         temperatures: tuple[float, ...]) -> None:
    """100 speculating requests with random stop tokens, temperatures and lengths, one
    aborted every 7 steps; integrity after every step; afterwards no block is left but the
    prefix cache's, and a stop token always ends its request (nothing emitted after it,
    even mid-draft)."""
    rng = random.Random(seed)
    for i in range(100):
        prompt = prompts[i % len(prompts)][:rng.randrange(8, 24)]
        sp = SamplingParams(temperature=rng.choice(temperatures),
                            max_tokens=rng.randrange(4, 30),
                            stop_token_ids=(rng.randrange(3, 12),), seed=i)
        e.add_request(prompt, sp, request_id=f"q{i}")
    run_with_aborts(e, rng, 7)
    assert len(e.completed) == 100 and e.scheduler.spec.num_drafts > 50
    stopped = [r for r in e.completed if r.status.value == "finished_stopped"]
    stops = set(e.executor.info.eos_token_ids)
    assert stopped and all(r.output_token_ids[-1] in set(r.sampling.stop_token_ids) | stops
                           for r in stopped)
    assert all(t not in set(r.sampling.stop_token_ids) | stops
               for r in stopped for t in r.output_token_ids[:-1])
    # Every block is back: only the prefix cache holds any, and clearing it frees them all.
    kv = e.kv
    assert not kv.tables and kv.pool.num_used == kv.tree.num_nodes
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks


def test_rollback_keeps_integrity_and_leaks_nothing_under_stops_and_aborts(tiny: Path) -> None:
    stop_and_abort_storm(engine(tiny, "ngram", num_blocks=60, num_speculative_tokens=5),
                         PROMPTS, 5, (0.0, 0.7))


def test_sim_speculation_is_priced_recorded_and_replayed(tmp_path: Path) -> None:
    ex = SimExecutor(SimConfig(eos_probability=0.02, spec_acceptance=0.6), seed=7)
    e = Engine(EngineConfig(block_size=8, num_blocks=300, seed=7, knobs=Knobs(
        max_num_batched_tokens=512, chunk_size=128, speculative_method="ngram",
        num_speculative_tokens=3)), ex)
    rec = record_headless(e, tmp_path)
    for i in range(16):
        e.add_request(list(range(5 + i, 90 + i)), SamplingParams(max_tokens=40),
                      request_id=f"r{i}", arrival_time=0.01 * i)
    live: list[dict] = []
    drive(e, 40, live)
    e.set_knobs(speculative_method="off")
    drive(e, 100_000, live)
    rec.close()
    stats = e.scheduler.spec
    assert stats.num_drafts > 0 and 0.3 < stats.acceptance_rate < 0.7
    replay = Replay(*read_run(tmp_path))
    state = replay.initial_state()
    for record, expected in zip(replay.steps, live, strict=True):
        state.apply(record)
        state.check_integrity()
        assert view_of(state.snapshot()) == expected
    assert state.snapshot().speculation == snapshot_of(e).speculation
