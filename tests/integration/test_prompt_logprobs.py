"""Prompt logprobs in the engine (`SamplingParams.prompt_logprobs`, what the server's `echo`
with `logprobs` reports): every prompt token after the first scored given the tokens before
it, once, whatever the chunking, the prefix cache or a preemption does — checked against a
contiguous forward pass of the whole prompt, on a tiny random model (fast, sliding-window
layers) and on the real Gemma 3 270M with both real executors."""

from __future__ import annotations

import pytest
import torch

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.text.sampling import TokenLogprobs
from tests.reference_forward import contiguous_logits

SCORED = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
PLAIN = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = [1, *[3 + (7 * i) % 89 for i in range(37)]]


@pytest.fixture(scope="module")
def tiny(tiny_gemma3):
    ex = TorchExecutor(tiny_gemma3, device="cpu", dtype="fp32", weight_activations="fp32")
    yield ex
    ex.close()


def engine(ex, chunk_size: int = 64, **config) -> Engine:
    """fp32 KV where the executor stores it (torch), so it computes what the fp32
    reference does."""
    kv = "fp32" if "fp32" in ex.info.kv_formats else "fp16"
    return Engine(EngineConfig(**config, knobs=Knobs(
        weight_format="dense", kv_format=kv, max_num_batched_tokens=256,
        chunk_size=chunk_size, max_num_seqs=4)), ex)


def finish(e: Engine, requests: list[Request]) -> None:
    while e.has_work:
        e.step()
        e.check_integrity()
    assert all(r.status.value.startswith("finished") for r in requests)


def run_one(e: Engine, prompt: list[int], sp: SamplingParams = SCORED) -> Request:
    req = e.add_request(prompt, sp)
    finish(e, [req])
    return req


def reference(ex, prompt: list[int], k: int) -> list[TokenLogprobs]:
    """Prompt token i + 1 scored by a contiguous forward's row i: the expected entries."""
    lp = torch.log_softmax(contiguous_logits(ex.model, prompt).float(), -1)
    top = lp[:-1].topk(k, -1)
    return [TokenLogprobs(float(lp[i, prompt[i + 1]]),
                          tuple(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True)))
            for i in range(len(prompt) - 1)]


def assert_same(got: list[TokenLogprobs], want: list[TokenLogprobs], tol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.logprob == pytest.approx(w.logprob, abs=tol), f"prompt token {i + 1}"
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=tol)
        # Ids of the alternatives: the same where their logprobs are not a near tie.
        gaps = [a - b for (_, a), (_, b) in zip(w.top, w.top[1:], strict=False)]
        if all(gap > 10 * tol for gap in gaps):
            assert [t for t, _ in g.top] == [t for t, _ in w.top]


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_every_prompt_token_is_scored_once_by_the_row_before_it(tiny, chunk_size) -> None:
    """Chunk boundaries (a chunk's first token is scored by the previous chunk's last row)
    and sliding-window layers (window 8) do not change a token's score."""
    req = run_one(engine(tiny, chunk_size), PROMPT)
    assert_same(req.prompt_logprobs_out, reference(tiny, PROMPT, 3), 1e-4)
    assert len(req.output_logprobs) == 0 and len(req.output_token_ids) == 3


def test_a_one_token_prompt_has_nothing_to_score(tiny) -> None:
    req = run_one(engine(tiny), [1])
    assert req.prompt_logprobs_out == [] and len(req.output_token_ids) == 3


def test_cached_prefixes_are_not_reused_for_positions_still_to_score(tiny) -> None:
    e = engine(tiny, block_size=4)
    warm = run_one(e, PROMPT, PLAIN)  # fills the prefix cache with the whole prompt
    again = run_one(e, PROMPT, PLAIN)
    assert again.num_cached_tokens == 36  # nine full blocks: the cache is in use
    scored = run_one(e, PROMPT)
    assert scored.num_cached_tokens == 0
    assert_same(scored.prompt_logprobs_out, reference(tiny, PROMPT, 3), 1e-4)
    assert scored.output_token_ids == warm.output_token_ids


def test_recompute_after_preemption_scores_no_token_twice(tiny) -> None:
    """Preempted after 15 of 38 prompt tokens (chunks of 5): readmitted, it reuses the three
    cached blocks it has already scored (12 tokens) and recomputes from there; positions
    12–14 are computed again but not scored again."""
    e = engine(tiny, chunk_size=5, block_size=4)
    req = e.add_request(PROMPT, SCORED)
    for _ in range(3):
        e.step()
    assert req.num_computed_tokens == 15 and len(req.prompt_logprobs_out) == 15
    assert e.scheduler.preempt_to_fit(0, e.clock.now(), "a test") == [req.request_id]
    e.step()
    assert req.num_preemptions == 1 and req.num_cached_tokens == 12
    finish(e, [req])
    alone = run_one(engine(tiny), PROMPT)
    assert_same(req.prompt_logprobs_out, alone.prompt_logprobs_out, 1e-5)
    assert req.output_token_ids == alone.output_token_ids


def test_requests_scoring_and_not_share_a_batch(tiny) -> None:
    """Scored rows sit among other requests' prefill and decode rows in one step."""
    e = engine(tiny, chunk_size=8)
    other = [5, *PROMPT[10:30]]
    reqs = [e.add_request(PROMPT, SCORED), e.add_request(other, PLAIN),
            e.add_request(other, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                prompt_logprobs=0))]
    finish(e, reqs)
    assert_same(reqs[0].prompt_logprobs_out, reference(tiny, PROMPT, 3), 1e-4)
    assert reqs[1].prompt_logprobs_out == []
    assert [lp.logprob for lp in reqs[2].prompt_logprobs_out] == pytest.approx(
        [lp.logprob for lp in reference(tiny, other, 1)], abs=1e-4)
    assert all(lp.top == () for lp in reqs[2].prompt_logprobs_out)


# -- the real model, both real executors ------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_torch(gemma_path):
    ex = TorchExecutor(gemma_path, device="cpu", dtype="fp32", weight_activations="fp32")
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def gemma_prompt(gemma_path) -> list[int]:
    from kvdeck.runtime.text.tokenizer import Tokenizer

    return Tokenizer(gemma_path).encode("The capital of France is Paris, and the capital of "
                                        "Italy is Rome. The capital of Spain is")


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [64, 7])
def test_gemma_torch_prompt_logprobs_match_a_contiguous_forward(gemma_torch, gemma_prompt,
                                                                chunk_size) -> None:
    req = run_one(engine(gemma_torch, chunk_size), gemma_prompt,
                  SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5))
    assert_same(req.prompt_logprobs_out, reference(gemma_torch, gemma_prompt, 5), 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [64, 7])
def test_gemma_llama_cpp_prompt_logprobs_match_llama_cpp_pythons_own_scores(
        gemma_path, gemma_prompt, chunk_size) -> None:
    """llama.cpp's logits depend on the shape of the batch a row is decoded in (by up to
    0.15 nats on Gemma 3 270M between chunks of 7 and one chunk), so the reference,
    llama-cpp-python evaluating the prompt with `logits_all`, takes batches of the same
    size."""
    import numpy as np

    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor
    from kvdeck.runtime.executors.llama_cpp_probe import open_llama
    from kvdeck.runtime.text.tokenizer import quiet_stderr

    with quiet_stderr():
        llm = open_llama(gemma_path, n_ctx=512, n_threads=2, n_batch=chunk_size,
                    n_ubatch=chunk_size, logits_all=True, verbose=False)
    llm.eval(gemma_prompt)
    lp = torch.log_softmax(torch.from_numpy(np.array(llm.scores[:len(gemma_prompt)])), -1)
    del llm
    top = lp[:-1].topk(5, -1)
    want = [TokenLogprobs(float(lp[i, t]), tuple(zip(top.indices[i].tolist(),
                                                     top.values[i].tolist(), strict=True)))
            for i, t in enumerate(gemma_prompt[1:])]
    ex = LlamaCppExecutor(gemma_path, threads=2, batch_invariant=True)
    try:
        req = run_one(engine(ex, chunk_size), gemma_prompt,
                      SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5))
    finally:
        ex.close()
    assert_same(req.prompt_logprobs_out, want, 1e-4)
