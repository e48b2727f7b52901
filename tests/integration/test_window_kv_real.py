"""Freeing window KV changes nothing the model computes: the torch executor on the real
Gemma 3 270M (3 full-attention and 15 sliding-window layers, window 512), run on the same
hand-built plans once with one group and once with its pool laid out in layer groups
(`kv/groups.py`), the local tables' blocks behind the window freed (−1) and their pages
poisoned with NaN, samples the same tokens with the same logits — through chunked prefill
past the window, decode rows beside a prefill chunk, and a pool re-laid by `convert_kv`."""

from __future__ import annotations

import random

import pytest
import torch

from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.core.step_data import ScheduledChunk, SchedulerOutput, StepResult
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.resources import PASSAGE
from kvdeck.runtime.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

P = 16
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
# (request, new tokens) per step; None: a decode row. "a" is 800 tokens of prompt in chunks
# of 256 (the last chunk starts 256 past the window), "b" a short prompt decoding beside it.
STEPS = [[("a", 256)], [("a", 256), ("b", 40)], [("a", 256), ("b", None)],
         [("a", 32), ("b", None)]] + [[("a", None), ("b", None)]] * 4
CONVERT_BEFORE = 6
"""The grouped run re-lays its pool (`convert_kv`, pages moved) before this step."""


@pytest.fixture(scope="module")
def executor(gemma_path) -> TorchExecutor:
    return TorchExecutor(gemma_path, device="cpu", dtype="fp32", threads=2,
                         record_logits=True)


@pytest.fixture(scope="module")
def prompts(gemma_path) -> dict[str, list[int]]:
    tok = Tokenizer(gemma_path)
    text = PASSAGE.read_text(encoding="utf-8")
    long = tok.encode(text + "\n\n" + text)[:800]
    assert len(long) == 800
    return {"a": long, "b": tok.encode(text[1500:])[:40]}


@torch.inference_mode()  # a pool `convert_kv` made is an inference tensor
def poison(ex: TorchExecutor, pages: list[int]) -> None:
    for layer in ex.kv.k + ex.kv.v:
        for part in layer:
            part[pages] = float("nan")


def generate(ex: TorchExecutor, prompts: dict[str, list[int]], groups: LayerGroups | None
             ) -> tuple[dict[str, list[int]], list[StepResult], int]:
    """Run STEPS; the sampled tokens per request, each step's result and the pages freed."""
    ex.logits_log.clear()
    reqs = {rid: Request(rid, list(p), GREEDY) for rid, p in prompts.items()}
    need = {rid: -(-(len(p) + len(STEPS)) // P) for rid, p in prompts.items()}
    sub = groups.pages_per_local_block if groups is not None else 0
    num_pages = sum(need.values()) * (1 + sub) + 8
    ids = list(range(num_pages))
    random.Random(0).shuffle(ids)  # pages in no order: a table is not a range

    def take(n: int) -> list[int]:
        out = ids[:n]
        del ids[:n]
        return out

    ex.bind_kv(num_pages, P, "fp32", groups)
    tables = {rid: take(n) for rid, n in need.items()}
    windows = {rid: [take(n) for _ in range(sub)] for rid, n in need.items()}
    if groups is not None:
        poison(ex, ids)  # the spare pages
    done = dict.fromkeys(reqs, 0)
    results = []
    freed = 0
    for step, todo in enumerate(STEPS):
        if groups is not None and step == CONVERT_BEFORE:
            relay(ex, tables, windows)
        chunks = []
        for rid, n in todo:
            req, start = reqs[rid], done[rid]
            n = n or 1
            chunk = ScheduledChunk(req, n, start, tables[rid], start + n == req.num_tokens)
            if groups is not None:
                first = groups.first_live_block(start, P)
                for table in windows[rid]:  # free the blocks behind the window
                    dead = [p for p in table[:first] if p >= 0]
                    poison(ex, dead)
                    freed += len(dead)
                    table[:first] = [-1] * first
                chunk.window_tables = windows[rid]
            chunks.append(chunk)
            done[rid] = start + n
        plan = SchedulerOutput(step=step, time=0.0, chunks=chunks)
        result = ex.execute(plan)
        for c in chunks:
            if c.sample:
                c.request.output_token_ids.append(result.sampled[c.request_id])
        results.append(result)
    return {rid: r.output_token_ids for rid, r in reqs.items()}, results, freed


def relay(ex: TorchExecutor, tables: dict, windows: dict) -> None:
    """Re-lay the pool in the same format with every live page moved, and the tables with
    it: pages must stay pages (`page_layers` slots each)."""
    live = [p for rid in tables for tb in (tables[rid], *windows[rid]) for p in tb if p >= 0]
    moved = dict(zip(live, reversed(live), strict=True))
    ex.convert_kv("fp32", ex.kv.num_blocks, list(moved), list(moved.values()))
    assert ex.kv.num_layers == ex.groups.page_layers
    for rid in tables:
        for tb in (tables[rid], *windows[rid]):
            tb[:] = [moved.get(p, -1) for p in tb]


def test_freed_window_kv_gives_the_same_tokens_and_logits(executor, prompts) -> None:
    ex = executor
    groups = ex.layer_groups()
    assert (groups.page_layers, groups.pages_per_local_block, groups.window) == (3, 5, 512)
    want, plain, _ = generate(ex, prompts, None)
    want_logits = list(ex.logits_log)
    got, grouped, freed = generate(ex, prompts, groups)
    # "a" ends at 804 tokens: its first 18 blocks are behind the window, 5 pages each.
    assert freed == 18 * 5
    assert got == want and len(got["a"]) == 5 and len(got["b"]) == 7
    assert len(ex.logits_log) == len(want_logits) == 12
    for (rid, n, logits), (rid0, n0, ref) in zip(ex.logits_log, want_logits, strict=True):
        assert (rid, n) == (rid0, n0)
        assert not logits.isnan().any(), f"{rid} at {n} read a freed or spare page"
        torch.testing.assert_close(logits, ref, atol=5e-4, rtol=1e-4)  # seen: 4e-5
    # KV read: the same while every context fits in the window, the local layers' share
    # capped at the window after.
    assert grouped[0].timing.bytes_read == plain[0].timing.bytes_read
    assert grouped[-1].timing.bytes_read < plain[-1].timing.bytes_read
    ex.bind_host_kv(4)
    assert ex.host_kv.num_layers == groups.page_layers  # swaps copy pages, slot for slot


def test_llama_cpp_refuses_free_window_kv(gemma_path) -> None:
    from kvdeck.runtime.errors import ConfigError
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    ex = LlamaCppExecutor(gemma_path, threads=2)
    try:
        with pytest.raises(ConfigError, match="^free_window_kv needs an executor that lays out "
                                              "KV pages .* the llama_cpp executor does not"):
            Engine(EngineConfig(free_window_kv=True), ex)
    finally:
        ex.close()
