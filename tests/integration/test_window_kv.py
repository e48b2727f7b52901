"""Freeing sliding-window KV (`free_window_kv`) through the whole engine on the torch
executor: outputs identical to keeping every layer's history, pages held as the window
allows, prefix hits, forks and speculation on top, and recordings that replay page for
page. A tiny random Gemma 3 (window 8) runs the many-request cases; the real Gemma 3 270M
runs the acceptance case, a prompt past 4,096 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.runs.recording import record_headless
from kvdeck.runtime.runs.replay import TraceState
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.integration.test_engine_sim import assert_replays_as_lived, view_of

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_gemma3):
    ex = TorchExecutor(tiny_gemma3, device="cpu", dtype="fp32", weight_activations="fp32")
    yield ex
    ex.close()


def engine(ex, free: bool, chunk_size: int = 8, num_blocks: int = 400, **knobs) -> Engine:
    knobs = {"weight_format": "dense", "kv_format": "fp32", "max_num_batched_tokens": 64,
             "chunk_size": chunk_size, "max_num_seqs": 8, **knobs}
    return Engine(EngineConfig(block_size=4, num_blocks=num_blocks, free_window_kv=free,
                               knobs=Knobs(**knobs)), ex)


def run(e: Engine, prompts: list[list[int]], sp: SamplingParams = GREEDY,
        live: list[dict] | None = None, **kw) -> list[Request]:
    """Serve `prompts` (the first half, then the rest once those finished: the second
    wave hits the prefix cache), checking the pool after every step."""
    reqs: list[Request] = []
    for wave in (prompts[:len(prompts) // 2], prompts[len(prompts) // 2:]):
        reqs += [e.add_request(p, sp, **kw) for p in wave]
        while e.has_work:
            if e.step() is not None and live is not None:
                live.append(view_of(snapshot_of(e)))
            e.check_integrity()
            for r in e.scheduler.running:
                if e.kv.groups and r.request_id in e.kv.window_tables:
                    # Nothing behind the window of the next position is held.
                    first = e.kv.groups.first_live_block(r.num_computed_tokens, 4)
                    assert all(t[:first] == [-1] * first
                               for t in e.kv.window_tables[r.request_id])
    return reqs


def outputs(reqs: list[Request]) -> list[list[int]]:
    return [r.output_token_ids for r in reqs]


PREFIX = [2 + (5 * i) % 61 for i in range(29)]
PROMPTS = [PREFIX + [70 + i, 3 + i] * (3 + i) for i in range(4)] + \
    [[9 + (3 * i) % 50 for i in range(45)], PREFIX + [88]]


def test_outputs_equal_keeping_every_layer(tiny, tmp_path: Path) -> None:
    keep = run(engine(tiny, False), PROMPTS)
    e = engine(tiny, True)
    rec = record_headless(e, tmp_path)
    live: list[dict] = []
    freed = run(e, PROMPTS, live=live)
    rec.close()
    assert outputs(freed) == outputs(keep)
    # Keeping every window block would hold 6 window pages per full-attention page.
    assert any(v["window"][2] < 6 * v["window"][1] for v in live)
    # The second wave reused the shared prefix, window pages and all.
    assert any(r.num_cached_tokens for r in freed[3:])
    assert e.kv.tree.local_of_page
    # The recording rebuilds every page, its group and every table, step for step.
    assert all(v["window"] is not None for v in live)
    assert_replays_as_lived(tmp_path, live)


def test_pages_held_follow_the_window(tiny) -> None:
    e = engine(tiny, True, chunk_size=8, enable_prefix_caching=False)
    g = e.groups
    assert (g.page_layers, g.pages_per_local_block, g.window) == (1, 6, 8)
    req = e.add_request([5 + i % 40 for i in range(60)], SamplingParams(max_tokens=4,
                                                                       ignore_eos=True))
    while e.has_work:
        e.step()
        e.check_integrity()
        if req.request_id in e.kv.tables:
            assert e.kv.window_counts() == g.pages_held(req.num_computed_tokens, 4)
    # At 63 tokens the window reads 56..63: 16 full pages, 2 window blocks of 6 pages, where
    # keeping every layer would hold 16 blocks of 7 layers (16 × 7 page-layers).
    assert g.pages_held(63, 4) == (16, 12)


def test_forks_and_speculation_on_top(tiny) -> None:
    prompt = [4, 5, 6, 7] * 12
    greedy3 = run(engine(tiny, False), [prompt], branches=3)
    freed3 = run(engine(tiny, True), [prompt], branches=3)
    assert [r.output_token_ids for r in greedy3[0].branches] == \
        [r.output_token_ids for r in freed3[0].branches]
    plain = run(engine(tiny, False), [prompt])
    e = engine(tiny, True, speculative_method="ngram", num_speculative_tokens=3)
    spec = run(e, [prompt])
    assert outputs(spec) == outputs(plain)
    assert e.scheduler.spec.num_drafts > 0


def test_refused_where_there_is_nothing_to_free(tiny, tiny_llama) -> None:
    ex = TorchExecutor(tiny_llama, device="cpu", dtype="fp32", weight_activations="fp32")
    try:
        with pytest.raises(ConfigError, match="free_window_kv needs a model with "
                                              "sliding-window layers"):
            engine(ex, True)
    finally:
        ex.close()
    with pytest.raises(ConfigError, match="cannot have a host KV tier"):
        Engine(EngineConfig(block_size=4, num_blocks=100, free_window_kv=True,
                            host_kv_memory_bytes=1 << 20), tiny)


def test_gemma3_long_prompt(gemma_path: Path) -> None:
    """The acceptance case: a 4,200-token prompt on Gemma 3 270M, greedy, with and without
    freeing: the same tokens, and the pages held fall by the factor the layer counts and
    the window give."""
    ex = TorchExecutor(gemma_path, device="cpu", dtype="fp32", weight_activations="fp32")
    prompt = [2] + [300 + (37 * i) % 9000 for i in range(4199)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    try:
        for free in (False, True):
            e = Engine(EngineConfig(block_size=16, num_blocks=2000, free_window_kv=free,
                                    knobs=Knobs(weight_format="dense", kv_format="fp16",
                                                chunk_size=512, max_num_batched_tokens=512,
                                                enable_prefix_caching=False)), ex)
            req = e.add_request(prompt, sp)
            held = []
            while e.has_work:
                e.step()
                e.check_integrity()
                if req.request_id in e.kv.tables:
                    held.append((req.num_computed_tokens, e.kv.pool.num_held))
            results[free] = (req.output_token_ids, held, e.groups)
    finally:
        ex.close()
    (keep_out, keep_held, _), (free_out, free_held, g) = results[False], results[True]
    assert free_out == keep_out
    assert (len(g.global_layers), len(g.local_layers), g.window) == (3, 15, 512)
    # Page-layers held once the prompt is in: every layer keeps 263 blocks, against 263
    # full-attention pages plus the window's blocks, 5 pages each.
    tokens, blocks = keep_held[-1]
    assert blocks == -(-tokens // 16)
    first_live = (tokens - 512 + 1) // 16
    expected = 18 * blocks / (3 * blocks + 15 * (blocks - first_live))
    tokens_w, pages = free_held[-1]
    assert tokens_w == tokens
    assert pages == blocks + 5 * (blocks - first_live)
    measured = 18 * blocks / (3 * pages)
    assert measured == pytest.approx(expected)
    assert measured > 3.5


def test_recording_started_mid_run_and_scrubbing_back(tiny, tmp_path: Path) -> None:
    """A recording that starts while requests hold window pages (its checkpoint carries
    them) replays as lived; a checkpoint replay takes of its own state, to scrub back,
    restores every window table too."""
    e = engine(tiny, True)
    reqs = [e.add_request(p, GREEDY) for p in PROMPTS[:3]]
    for _ in range(7):
        e.step()
    assert any(t[0] == -1 for wt in e.kv.window_tables.values() for t in wt)
    rec = record_headless(e, tmp_path)
    live: list[dict] = []
    while e.has_work:
        if e.step() is not None:
            live.append(view_of(snapshot_of(e)))
        e.check_integrity()
    rec.close()
    assert all(r.status.value == "finished_length" for r in reqs)
    replay = assert_replays_as_lived(tmp_path, live)
    state = replay.initial_state()
    for record in replay.steps[:3]:
        state.apply(record)
    back = TraceState(replay.header)
    back.restore(state.checkpoint())
    back.check_integrity()
    assert back.window_tables == state.window_tables
    for record, expected in zip(replay.steps[3:], live[3:], strict=True):
        back.apply(record)
        back.check_integrity()
        assert view_of(back.snapshot())["window"] == expected["window"]


def test_forked_window_tails_replay_with_their_copies(tiny, tmp_path: Path) -> None:
    e = engine(tiny, True)
    rec = record_headless(e, tmp_path)
    live: list[dict] = []
    run(e, [[4, 5, 6, 7] * 10 + [9]], live=live, branches=3)
    rec.close()
    # Three samples share the prompt's partial tail: two copy it, its full-attention page
    # and its 6 window pages each, and the replay counts the same copies.
    assert e.kv.num_cow_copies == 2 * (1 + 6)
    assert_replays_as_lived(tmp_path, live)


def test_full_reservation_counts_every_window_page(tiny) -> None:
    e = engine(tiny, True, reservation="full", num_blocks=300)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ok = e.add_request(PROMPTS[0], sp)
    # 220 tokens are 55 blocks: 385 pages promised in full, more than the pool's 300 (a
    # lazy admission would need 55 + 5 window blocks of 6 pages at most).
    big = e.add_request([3 + i % 80 for i in range(200)], sp)
    assert e.kv.pages_for(220, 8) == 85
    while e.has_work:
        e.step()
        e.check_integrity()
    assert ok.status.value == "finished_length"
    assert big.status.value == "rejected"
    assert "needs 385 KV pages (full-attention and window blocks) for prompt + max_tokens" \
        in big.reason
