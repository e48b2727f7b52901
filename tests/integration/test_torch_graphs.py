"""CUDA graphs for the torch executor's decode steps (`--graph-buckets`): on CUDA, every
request's tokens are those of eager steps, padding shows in the step timing, and a pool
re-laid by a KV-format switch drops the graphs; elsewhere the buckets change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.executors.torch_graphs import width_bucket
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import load

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Lengths that spread the decode rows over several buckets and block-table widths.
PROMPTS = [[3 + (i * 11 + j) % 90 for j in range(n)] for i, n in enumerate((2, 9, 31, 5, 50))]


def run(path: Path, device: str, buckets: str, free_window_kv: bool = False,
        switch_at: int = 0) -> tuple[dict[str, list[int]], Engine, list[int]]:
    """Every request's output tokens, the engine and each step's padding rows; prompts
    arrive over the first steps (so decode steps see 1 to 5 rows), and the KV format is
    switched at step `switch_at` (0: never)."""
    ex = TorchExecutor(path, device=device, dtype="fp32", graph_buckets=buckets)
    e = Engine(EngineConfig(block_size=4, num_blocks=160, free_window_kv=free_window_kv,
                            knobs=Knobs(chunk_size=16, kv_format="fp32")), ex)
    padding, step = [], 0
    while step < len(PROMPTS) or e.has_work:
        if step < len(PROMPTS):
            e.add_request(PROMPTS[step], GREEDY, request_id=f"r{step}")
        if switch_at and step == switch_at:
            e.set_knobs(kv_format="fp16")
        record = e.step()
        e.check_integrity()
        padding.append(record.padding if record is not None else 0)
        step += 1
    return {r.request_id: r.output_token_ids for r in e.completed}, e, padding


def test_width_buckets_round_up_by_at_most_half() -> None:
    assert [width_bucket(w) for w in (1, 2, 3, 4, 5, 7, 9, 13, 17, 33)] == \
        [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]


def test_buckets_off_cuda_run_every_step_eagerly(tiny_llama: Path) -> None:
    graphed, e, padding = run(tiny_llama, "cpu", "1,2,4")
    assert graphed == run(tiny_llama, "cpu", "")[0]
    assert not e.executor.graphs.on and e.executor.graphs.lines() == ()
    assert not any(padding)
    assert e.executor.kv.spare == 0


def test_the_setting_reaches_the_torch_executor(tiny_llama: Path) -> None:
    settings = load(None, {"model": str(tiny_llama), "device": "cpu", "graph_buckets": "4,1"})
    assert settings.flat()["graph_buckets"] == "4,1"  # kept where a config is written
    session = build_session(settings, with_tokenizer=False)
    try:
        assert session.engine.executor.graphs.buckets == (1, 4)
    finally:
        session.close()


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma3"])
def test_decode_graphs_give_the_eager_tokens(model: str, request) -> None:
    path = request.getfixturevalue(model)
    eager = run(path, "cuda", "")[0]
    graphed, e, padding = run(path, "cuda", "1,2,4")
    assert graphed == eager
    graphs = e.executor.graphs
    assert graphs.replays > 0 and graphs.graphs and not graphs.off and graphs.pool_bytes > 0
    assert 0 < max(padding) < 4  # e.g. 3 rows in the 4-row graph
    assert e.executor.graphs.lines()[0].startswith("CUDA graphs at 1,2,4 rows:")


@pytest.mark.cuda
def test_grouped_pages_and_a_format_switch_keep_the_eager_tokens(tiny_gemma3: Path) -> None:
    eager = run(tiny_gemma3, "cuda", "", free_window_kv=True, switch_at=6)[0]
    graphed, e, _ = run(tiny_gemma3, "cuda", "2,4,8", free_window_kv=True, switch_at=6)
    assert graphed == eager
    assert e.executor.kv.spare == 1 and e.executor.graphs.replays > 0
