"""Token-level KV eviction through the whole engine on the torch executor: a prompt longer
than the pool completes under each mode (beside a short one, with forks and speculation on
top), the pool never holds more than the bound admission used, the KV map says what was
evicted, and the recording replays block for block; with eviction off the same prompt is
refused with a sentence; and with nothing to evict the outputs are those of eviction off.
A tiny random Gemma 3 runs those; the real Gemma 3 270M runs the acceptance case through
`kvdeck quality --kv-eviction`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.runs.recording import record_headless
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.integration.test_engine_sim import assert_replays_as_lived, view_of

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = [2 + (7 * i) % 89 for i in range(160)]  # 40 blocks of 4 tokens; the pool holds 20


@pytest.fixture(scope="module")
def tiny(tiny_gemma3):
    ex = TorchExecutor(tiny_gemma3, device="cpu", dtype="fp32", weight_activations="fp32")
    yield ex
    ex.close()


def engine(ex, mode: str, num_blocks: int = 20, recent: int = 16, **knobs) -> Engine:
    knobs = {"weight_format": "dense", "kv_format": "fp32", "max_num_batched_tokens": 16,
             "chunk_size": 8, "max_num_seqs": 4, **knobs}
    return Engine(EngineConfig(block_size=4, num_blocks=num_blocks, kv_eviction=mode,
                               kv_sink_tokens=4, kv_recent_tokens=recent, kv_heavy_tokens=16,
                               knobs=Knobs(**knobs)), ex)


@pytest.mark.parametrize("mode", ["sink-window", "heavy-hitter"])
def test_a_prompt_longer_than_the_pool_completes(tiny, mode: str, tmp_path: Path) -> None:
    e = engine(tiny, mode)
    rec = record_headless(e, tmp_path)
    reqs = [e.add_request(LONG, GREEDY), e.add_request(LONG[:30], GREEDY)]
    live, lines, middle = [], set(), False
    bound = e.kv.pages_for(len(LONG) + 12, 8)
    while e.has_work:
        if e.step() is not None:
            snap = snapshot_of(e)
            live.append(view_of(snap))
            lines.add(snap.kv.eviction.split(" · ")[0])
            e.check_integrity()
            for r in e.scheduler.running:
                table = e.kv.table(r.request_id)
                assert sum(b >= 0 for b in table) <= bound
                # Kept between the sink and the recent window: a heavy hitter.
                first_recent = (r.num_computed_tokens - 16) // 4
                middle |= any(b >= 0 for b in table[1:max(first_recent, 1)])
    rec.close()
    assert [r.status for r in reqs] == [RequestStatus.FINISHED_LENGTH] * 2
    assert all(len(r.output_token_ids) == 12 for r in reqs)
    assert e.kv.eviction.num_evicted_blocks > 20
    heavy = " + 16 heaviest" if mode == "heavy-hitter" else ""
    assert lines == {f"eviction {mode}: 4 sink + 16 recent{heavy} tokens kept"}
    assert middle == (mode == "heavy-hitter")
    assert_replays_as_lived(tmp_path, live)


def test_with_eviction_off_the_same_prompt_is_refused(tiny) -> None:
    e = engine(tiny, "off")
    req = e.add_request(LONG, GREEDY)
    e.run_until_idle()
    assert req.status is RequestStatus.REJECTED
    assert req.reason == ("needs 40 KV blocks for its prompt (160 tokens) but the pool has 20 "
                          "blocks of 4 tokens (token-level eviction, --kv-eviction "
                          "sink-window, would run it lossily)")


def test_forks_and_speculation_on_top(tiny) -> None:
    e = engine(tiny, "sink-window", num_blocks=40, speculative_method="ngram",
               num_speculative_tokens=3)
    req = e.add_request(LONG, GREEDY, branches=2)
    while e.has_work:
        e.step()
        e.check_integrity()
    assert all(len(b.output_token_ids) == 12 for b in req.branches)
    assert e.scheduler.spec.num_drafts > 0 and e.kv.eviction.num_evicted_blocks


def test_with_nothing_to_evict_the_outputs_are_those_of_eviction_off(tiny) -> None:
    prompts = [LONG[:40], LONG[50:70]]
    outs = []
    for mode in ("off", "sink-window", "heavy-hitter"):
        e = engine(tiny, mode, num_blocks=60, recent=64)
        reqs = [e.add_request(p, GREEDY) for p in prompts]
        e.run_until_idle()
        assert e.kv.eviction.num_evicted_blocks == 0
        outs.append([r.output_token_ids for r in reqs])
    assert outs[0] == outs[1] == outs[2]


def test_quality_reports_what_eviction_costs_on_gemma3(gemma_path: Path) -> None:
    """The acceptance case: the shipped passage (more tokens than the 24-block pool holds)
    completes under each mode, and `kvdeck quality` reports its figures."""
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "quality",
                        "--kv-eviction", "sink-window,heavy-hitter", "--json"],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    rows = {q["label"]: q for q in json.loads(r.stdout)}
    assert set(rows) == {"sink-window: 4 sink + 128 recent tokens kept",
                         "window alone (no sink)",
                         "heavy-hitter: 4 sink + 128 recent + 64 heaviest tokens kept"}
    for q in rows.values():
        assert q["tokens"] > q["pool_blocks"] * 16 and q["evicted_blocks"] > 0
        assert 0.0 < q["top1_agreement"] <= 1.0 and q["mean_abs_dlogit"] >= 0.0
        assert q["scored_from"] == 16 + 128
    # StreamingLLM's finding: the window alone loses far more than with its sink tokens.
    sink = rows["sink-window: 4 sink + 128 recent tokens kept"]
    assert sink["top1_agreement"] > rows["window alone (no sink)"]["top1_agreement"]


def test_served_a_prompt_longer_than_the_pool_completes() -> None:
    """`kvdeck serve` with eviction, asked through the official client: the shipped passage
    (506 tokens on Gemma 3) in a pool of 288 tokens answers, and /metrics counts the blocks
    evicted."""
    import httpx
    from openai import OpenAI

    from kvdeck.runtime.resources import PASSAGE
    from tests.servers import serve_process

    with serve_process("--executor", "torch", "--kv-eviction", "sink-window",
                       "--kv-recent-tokens", "128", "--chunk-size", "64",
                       "--kv-cache-dtype", "fp16", "--kv-memory-gib", "0.005",
                       start_timeout_s=300) as srv:
        client = OpenAI(base_url=srv.url, api_key="none")
        r = client.completions.create(model="gemma3-270m", prompt=PASSAGE.read_text(),
                                      max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens > 18 * 16 and r.usage.completion_tokens == 8
        metrics = httpx.get(srv.url.removesuffix("/v1") + "/metrics").text
        (line,) = [x for x in metrics.splitlines()
                   if x.startswith("kvdeck:kv_token_evicted_blocks_total")]
        assert float(line.split()[-1]) > 0
