"""One engine-level suite over the real executors (`torch`, `llama_cpp`) on Gemma 3 270M:
continuous batching does not change greedy outputs, prefix sharing gives the same tokens as
no sharing, abort and preemption keep integrity and leak nothing, stop strings and seeds
behave the same. Plus the llama.cpp executor against llama-cpp-python's own generation."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.text.tokenizer import Tokenizer, quiet_stderr
from tests.integration.test_speculation import run, run_with_aborts

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is", "def fibonacci(n):",
         "Once upon a time, in a small village,", "1, 2, 3, 4,",
         "The best way to learn a language is", "import numpy as np\n",
         "Dear Sir or Madam,", "The mitochondria is"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
EXECUTORS = ["torch", "llama_cpp"]


@pytest.fixture(scope="module", params=EXECUTORS)
def executor(request, gemma_path):
    if request.param == "torch":
        from kvdeck.runtime.executors.torch import TorchExecutor

        ex = TorchExecutor(gemma_path, device="cpu", dtype="fp32", weight_activations="fp32")
    else:
        from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

        # Exact mode: llama.cpp's batched decode rows are not batch-invariant.
        ex = LlamaCppExecutor(gemma_path, threads=2, batch_invariant=True)
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def tok(gemma_path) -> Tokenizer:
    return Tokenizer(gemma_path)


def engine(ex, **kw) -> Engine:
    num_blocks = kw.pop("num_blocks", None)
    return Engine(EngineConfig(num_blocks=num_blocks, knobs=Knobs(
        weight_format="dense", max_num_batched_tokens=256, chunk_size=128,
        max_num_seqs=min(8, ex.info.max_sequences), **kw)), ex)


def test_eight_concurrent_greedy_requests_match_each_alone(executor, tok) -> None:
    prompts = [tok.encode(t) for t in TEXTS]
    alone = {}
    for i, p in enumerate(prompts):
        alone.update(run(engine(executor), [(f"r{i}", p, GREEDY)]))
    together = run(engine(executor), [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    assert together == alone


def test_prefix_sharing_gives_the_same_tokens_as_no_sharing(executor, tok) -> None:
    system = tok.encode("You are a helpful assistant who answers in one short sentence. " * 4)
    requests = [(f"s{i}", system + tok.encode(t, add_bos=False), GREEDY)
                for i, t in enumerate(TEXTS[:4])]
    shared = engine(executor)
    with_sharing = {}
    for r in requests:  # one after another, so each later request hits the cached prefix
        with_sharing.update(run(shared, [r]))
    assert shared.kv.tree.num_hit_tokens >= 3 * (len(system) // 16) * 16
    without = run(engine(executor, enable_prefix_caching=False), requests)
    assert with_sharing == without


def test_abort_and_preemption_keep_integrity_and_leak_nothing(executor, tok) -> None:
    rng = random.Random(1)
    e = engine(executor, num_blocks=96 if executor.info.slots else 16)
    for i in range(12):
        e.add_request(tok.encode(TEXTS[i % 8] * 3), SamplingParams(
            temperature=rng.choice((0.0, 0.8)), max_tokens=rng.randrange(16, 40), seed=i,
            ignore_eos=True), request_id=f"q{i}")
    run_with_aborts(e, rng, 9)
    assert len(e.completed) == 12
    # llama.cpp slots split the pool evenly, so the running requests always fit in it:
    # only the torch executor's shared pool runs short here and preempts.
    assert e.scheduler.num_preemptions > 0 or executor.info.slots
    kv = e.kv
    assert not kv.tables and kv.pool.num_used == kv.tree.num_nodes
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks


def test_stop_strings_and_seeds_behave_the_same(executor, tok) -> None:
    e = Engine(EngineConfig(knobs=Knobs(weight_format="dense", max_num_seqs=8)), executor,
               tokenizer=tok)
    prompt = tok.encode("1, 2, 3, 4, 5,")
    stop = e.add_request(prompt, SamplingParams(temperature=0, max_tokens=32, stop=(" 8",)),
                         request_id="stop")
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=42, ignore_eos=True)
    first = e.add_request(prompt, sp, request_id="a")
    second = e.add_request(prompt, sp, request_id="b")
    e.run_until_idle()
    e.check_integrity()
    assert stop.status.value == "finished_stopped" and stop.output_text.endswith(" 7,")
    assert first.output_token_ids == second.output_token_ids


def test_llama_cpp_kv_format_switch_re_prefills_running_requests_in_the_pause(gemma_path,
                                                                          tok) -> None:
    """fp16 → q8_0 → q4_0 → fp16 while eight requests decode: each switch recreates the
    context and re-prefills every running request before the next step, so that step
    recomputes nothing; the switch's seconds are the pause; every request completes."""
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    ex = LlamaCppExecutor(gemma_path, threads=2)
    try:
        e = engine(ex)
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i, t in enumerate(TEXTS):
            e.add_request(tok.encode(t), sp, request_id=f"r{i}")
        for fmt in ("q8_0", "q4_0", "fp16"):
            for _ in range(6):
                e.step()
            e.set_knobs(kv_format=fmt)
            e.step()
            sw = e.switcher.recent[-1]
            assert sw.new == fmt == ex.kv_format and sw.seconds > 0
            # Every running request's slot holds exactly its computed tokens again.
            for r in e.scheduler.running:
                assert ex._length[ex._seq_of[r.request_id]] == r.num_computed_tokens
            assert sw.bytes == sum(
                r.num_computed_tokens - 1 for r in e.scheduler.running) * (
                ex.kv_bytes_per_token(sw.old) + ex.kv_bytes_per_token(fmt))
            e.check_integrity()
        e.run_until_idle()
        e.check_integrity()
        assert len(e.completed) == 8
        assert all(len(r.output_token_ids) == 40 for r in e.completed)
    finally:
        ex.close()


@pytest.fixture(scope="module", params=["gemma", "qwen"])
def reference(request, gemma_path, chat_model_path):
    """(model path, prompts, llama-cpp-python's own greedy 24 tokens for each)."""
    from kvdeck.runtime.executors.llama_cpp_probe import open_llama

    path = gemma_path if request.param == "gemma" else chat_model_path
    tok = Tokenizer(path)
    prompts = [tok.encode(t) for t in TEXTS[:4]]
    with quiet_stderr():
        llm = open_llama(path, n_ctx=512, n_threads=2, verbose=False, seed=0)
    expected = {}
    for i, p in enumerate(prompts):  # greedy, on past an end of sequence (ignore_eos)
        llm.reset()  # else it reuses the previous prompt's cache, and its output changes
        gen = llm.generate(p, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        expected[f"r{i}"] = [next(gen) for _ in range(24)]
        gen.close()
    del llm
    return path, prompts, expected


def test_llama_cpp_greedy_equals_llama_cpp_python_generation(reference) -> None:
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    path, prompts, expected = reference
    ex = LlamaCppExecutor(path, threads=2, batch_invariant=True)
    try:
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        got = run(engine(ex), [(f"r{i}", p, sp) for i, p in enumerate(prompts)])
    finally:
        ex.close()
    assert got == expected


def test_served_llama_cpp_greedy_equals_llama_cpp_python_generation(reference) -> None:
    """The same through `kvdeck serve --executor llama_cpp`, four requests at once, with
    the official client."""
    import openai

    from tests.servers import serve_process

    path, prompts, expected = reference
    tok = Tokenizer(path)
    with serve_process("--executor", "llama_cpp", "--batch-invariant", "--threads", "2",
                       "--model", str(path), "--served-model-name", "m") as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: client.completions.create(
                model="m", prompt=p, max_tokens=24, temperature=0.0,
                extra_body={"ignore_eos": True}), prompts))
    for i, a in enumerate(answers):
        assert a.usage.completion_tokens == 24
        assert a.choices[0].text == tok.decode(expected[f"r{i}"])


def test_llama_cpp_a_recycled_slots_prefix_leaves_the_cache(gemma_path, tok) -> None:
    """Two slots. A finishes and its slot, retired, holds its prompt's blocks, which the
    prefix cache holds too. B and C then need both slots: C's recycles A's, whose KV
    llama.cpp no longer has, so the cache drops those blocks (instead of handing them to a
    later request, which would then recompute them outside the token budget). A later
    request with A's prompt computes it again as a prefill, and gets A's tokens."""
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    ex = LlamaCppExecutor(gemma_path, threads=2, n_parallel=2, batch_invariant=True)
    try:
        e = Engine(EngineConfig(num_blocks=64, knobs=Knobs(
            weight_format="dense", max_num_batched_tokens=256, chunk_size=128,
            max_num_seqs=2)), ex)
        a = tok.encode(" ".join(TEXTS[:4]) * 2)
        first = run(e, [("a", a, GREEDY)])["a"]
        assert e.kv.peek_prefix(e.completed[-1]) >= 16  # cached, and slot 0 holds it
        run(e, [("b", tok.encode(TEXTS[4] * 3), GREEDY), ("c", tok.encode(TEXTS[5] * 3),
                                                          GREEDY)])
        assert e.kv.tree.node_of_block.keys().isdisjoint(
            b for b in range(64) if not any(b in held for held in ex._blocks.values())), \
            "the cache holds a block no slot has"
        again = run(e, [("a2", a, GREEDY)])["a2"]
        a2 = next(r for r in e.completed if r.request_id == "a2")
        assert a2.num_cached_tokens == 0 and again == first
        e.check_integrity()
    finally:
        ex.close()


@pytest.mark.skipif(not hasattr(psutil.Process, "memory_maps"),
                    reason="psutil lists a process's mappings on Linux, not on macOS")
def test_a_llama_cpp_executor_let_go_without_close_frees_its_model(gemma_path, tok) -> None:
    """An executor dropped without `close()` (a stopped server let go, a session a test
    built) frees llama.cpp's model and context when it is collected: the process no longer
    maps the GGUF file (docs/executors.md)."""
    import gc

    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    def mappings() -> int:
        """How many times the process maps the GGUF file (once for each model loaded;
        the module's executor fixture may hold one)."""
        real = gemma_path.resolve()
        return sum(bool(m.path) and Path(m.path).resolve() == real
                   for m in psutil.Process().memory_maps(grouped=False))

    gc.collect()  # an earlier test's executor in a cycle goes now, not during this one
    held = mappings()
    ex = LlamaCppExecutor(gemma_path, threads=2, n_parallel=2)
    e = engine(ex)
    run(e, [("a", tok.encode(TEXTS[0]), GREEDY)])
    e.check_integrity()
    assert mappings() > held
    del e, ex
    gc.collect()
    assert mappings() == held
