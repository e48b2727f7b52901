"""Paged equals contiguous: the torch executor's logits, produced through block tables under
continuous batching, chunked prefill, forks with copy-on-write and preemption, match a plain
contiguous-KV forward pass of the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.errors import ConfigError, ModelFileError
from kvdeck.runtime.executors.torch import TorchExecutor
from tests.factories import TinySpec, write_tiny_gguf
from tests.reference_forward import contiguous_logits

SPECS = {
    "llama": TinySpec(arch="llama"),
    "qwen2": TinySpec(arch="qwen2", num_layers=3),
    "gemma3": TinySpec(arch="gemma3", num_layers=7, num_kv_heads=1, sliding_window=8),
}
GREEDY6 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5 + (i * 7 + j) % 80 for j in range(n)] for i, n in enumerate((3, 17, 40, 9))]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_gguf(d / f"{arch}.gguf", spec) for arch, spec in SPECS.items()}


def make_engine(path: Path, block_size: int, chunk: int, num_blocks: int = 256,
                budget: int = 64) -> Engine:
    ex = TorchExecutor(path, device="cpu", dtype="fp32", record_logits=True)
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks,
                       knobs=Knobs(chunk_size=chunk, max_num_batched_tokens=budget,
                                   kv_format="fp32"))
    return Engine(cfg, ex)


def assert_matches_reference(engine: Engine) -> int:
    """Every recorded logits row equals the contiguous pass over the final sequence."""
    ex: TorchExecutor = engine.executor  # type: ignore[assignment]
    by_id = {r.request_id: r for r in engine.completed}
    refs = {rid: contiguous_logits(ex.model, r.prompt_token_ids + r.output_token_ids)
            for rid, r in by_id.items()}
    for rid, num_tokens, logits in ex.logits_log:
        torch.testing.assert_close(logits, refs[rid][num_tokens - 1], atol=2e-4, rtol=1e-4)
    return len(ex.logits_log)


@pytest.mark.parametrize("arch", SPECS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_paged_equals_contiguous(tiny_models, arch: str, block_size: int, chunk: int) -> None:
    e = make_engine(tiny_models[arch], block_size, chunk)
    for i, prompt in enumerate(PROMPTS):  # staggered: decodes and prefill chunks mix
        e.add_request(prompt, GREEDY6,
                      request_id=f"r{i}", arrival_time=0.0)
        e.step()
    e.run_until_idle()
    e.check_integrity()
    assert len(e.completed) == 4
    assert assert_matches_reference(e) == 4 * 6


@pytest.mark.parametrize("arch", SPECS)
def test_fork_copies_the_shared_tail_and_matches(tiny_models, arch: str) -> None:
    e = make_engine(tiny_models[arch], block_size=4, chunk=64)
    e.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                  request_id="p")
    e.step()  # prefill (40 tokens) + first token: 41 tokens, a partial tail block
    e.step()
    parent = e.scheduler.running[0]
    assert parent.num_tokens % 4 != 0
    child = e.scheduler.fork(parent, "c")
    e.run_until_idle()
    e.check_integrity()
    assert e.kv.num_cow_copies >= 1
    done = {r.request_id: r for r in e.completed}
    assert done["c"].output_token_ids == done["p"].output_token_ids  # greedy, same context
    assert child.num_output_tokens == 8
    assert_matches_reference(e)


@pytest.mark.parametrize("arch", SPECS)
def test_preemption_then_recompute_matches(tiny_models, arch: str) -> None:
    # 20 blocks of 4 tokens cannot hold four requests growing to 46 tokens each.
    e = make_engine(tiny_models[arch], block_size=4, chunk=16, num_blocks=20)
    for i, prompt in enumerate(PROMPTS):
        e.add_request(prompt, GREEDY6, request_id=f"r{i}")
    e.run_until_idle()
    e.check_integrity()
    assert e.scheduler.num_preemptions > 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in e.completed)
    assert_matches_reference(e)


def test_sampling_is_reproducible_and_batch_independent(tiny_models) -> None:
    outs = []
    for extra in (0, 3):  # the same seeded request alone, then beside others
        e = make_engine(tiny_models["llama"], block_size=4, chunk=64)
        for j in range(extra):
            e.add_request(PROMPTS[j], SamplingParams(temperature=1.0, max_tokens=10))
        r = e.add_request(PROMPTS[3], SamplingParams(temperature=0.9, top_p=0.9, top_k=20,
                                                     seed=1234, max_tokens=10))
        e.run_until_idle()
        outs.append(r.output_token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 10


def test_stop_token_and_logprobs(tiny_models) -> None:
    e = make_engine(tiny_models["qwen2"], block_size=4, chunk=64)
    probe = e.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5))
    e.run_until_idle()
    stop_at = probe.output_token_ids[2]
    r = e.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                 stop_token_ids=(stop_at,)))
    e.run_until_idle()
    first = probe.output_token_ids.index(stop_at)
    assert r.output_token_ids == probe.output_token_ids[:first + 1]
    assert r.status is RequestStatus.FINISHED_STOPPED
    lp = r.output_logprobs[0]
    assert len(lp.top) == 3 and lp.top[0][0] == r.output_token_ids[0]
    assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


def test_bad_arguments_are_refused(tiny_models, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dtypes are fp32, bf16, fp16, int8"):
        TorchExecutor(tiny_models["llama"], dtype="fp8")
    with pytest.raises(ConfigError, match="Unknown device 'tpu'"):
        TorchExecutor(tiny_models["llama"], device="tpu")
    ex = TorchExecutor(tiny_models["llama"])
    with pytest.raises(ConfigError, match=r"kv_format 'q4_0' is not available here \(head "
                                          r"dim 16 is not a multiple of 32\)"):
        Engine(EngineConfig(num_blocks=8, knobs=Knobs(kv_format="q4_0")), ex)
    bert = write_tiny_gguf(tmp_path / "bert.gguf", TinySpec(arch="bert"))
    with pytest.raises(ModelFileError, match="is a 'bert' model; the torch executor runs "
                                             "gemma3, llama, qwen2, qwen3."):
        TorchExecutor(bert)


@pytest.mark.cuda
def test_cuda_paged_equals_contiguous(tiny_models) -> None:
    ex = TorchExecutor(tiny_models["gemma3"], device="cuda", dtype="fp32", record_logits=True)
    e = Engine(EngineConfig(block_size=4, num_blocks=128,
                            knobs=Knobs(chunk_size=7, kv_format="fp32")), ex)
    for i, prompt in enumerate(PROMPTS):
        e.add_request(prompt, GREEDY6, request_id=f"r{i}")
    e.run_until_idle()
    by_id = {r.request_id: r for r in e.completed}
    for rid, n, logits in ex.logits_log:
        r = by_id[rid]
        ref = contiguous_logits(ex.model, r.prompt_token_ids + r.output_token_ids)[n - 1]
        torch.testing.assert_close(logits, ref.cpu(), atol=1e-3, rtol=1e-3)
