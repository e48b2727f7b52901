"""Mixed LoRA adapters in one batch against the base model alone, same concurrency.

Model: Gemma 3 270M (the embedded GGUF) on the torch executor (its default weights for this
machine), then on the llama_cpp executor (one `llama_decode` per adapter in a step, so a
mixed step is three passes over the weights there). Adapters: two rank-8 adapters on q,
v, up and down projections of every layer (one PEFT folder, one llama.cpp GGUF;
`tests/adapters.py`). Workload: eight prompts submitted
together (all eight decode in one batch), greedy, exactly 64 output tokens each; "mixed"
sends three to the base, three to adapter a, two to b. Three rounds of each, interleaved;
printed: each run's output tokens per second (median of its rounds) and mixed/base.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.text.tokenizer import Tokenizer
from tests.adapters import shapes_of, write_gguf, write_peft

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The quick brown fox", "In 1969, astronauts", "Water boils at",
           "My favourite colour is", "The best way to learn"]
MIXED = [None, "a", "b", None, "a", "b", "a", None]
ROUNDS = 3


def tokens_per_second(executor, tokenizer, adapters: list[str | None]) -> float:
    engine = Engine(EngineConfig(kv_memory_bytes=256 << 20, knobs=Knobs(max_num_seqs=8)),
                    executor, tokenizer=tokenizer)
    reqs = [engine.add_request(tokenizer.encode(p), SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, lora=lora))
        for p, lora in zip(PROMPTS, adapters, strict=True)]
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    return sum(r.num_output_tokens for r in reqs) / (time.perf_counter() - start)


def compare(executor, tokenizer, what: str) -> None:
    """Base alone against base + a + b on `executor` (adapters loaded), printed."""
    tokens_per_second(executor, tokenizer, [None] * 8)  # warm-up
    base, mixed = [], []
    for _ in range(ROUNDS):
        base.append(tokens_per_second(executor, tokenizer, [None] * 8))
        mixed.append(tokens_per_second(executor, tokenizer, MIXED))
    b, m = statistics.median(base), statistics.median(mixed)
    print(f"LoRA in one batch (Gemma 3 270M, {what}, 8 concurrent, 64 tokens each, median "
          f"of {ROUNDS}):")
    print(f"  base alone      {b:8.1f} tok/s")
    print(f"  base + a + b    {m:8.1f} tok/s   mixed/base {m / b:.2f}×")


def main() -> None:
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    path = resolve_model(DEFAULT_MODEL)
    tokenizer = Tokenizer(path)
    executor = TorchExecutor(path)
    with tempfile.TemporaryDirectory() as folder:
        shapes = shapes_of(executor.model)
        files = {"a": write_peft(Path(folder) / "a", shapes, seed=1),
                 "b": write_gguf(Path(folder) / "b.gguf", shapes, seed=2)}
        for name, file in files.items():
            executor.load_adapter(name, file)
        compare(executor, tokenizer, f"torch, weights {executor.weight_formats}")
        executor.close()
        executor = LlamaCppExecutor(path, n_parallel=8)
        for name, file in files.items():
            executor.load_adapter(name, file)
        compare(executor, tokenizer, "llama_cpp")
        executor.close()


if __name__ == "__main__":
    main()
