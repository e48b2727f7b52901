"""Torch and llama_cpp executors vs llama-cpp-python on the same model and requests.

Model: Gemma 3 270M (Q4_K_M GGUF, the embedded default). Requests: 32 distinct 128-token
prompts (windows of a fixed English text), 64 output tokens each, greedy, end-of-sequence
suppressed so every request generates exactly 64 tokens. llama-cpp-python's high-level API
generates them one after another (its sequential throughput does not depend on how many);
kvdeck's llama_cpp executor (llama.cpp's kernels under kvdeck's scheduler) and its torch
executor (fp32 and int8) serve them with continuous batching at concurrency 1 and 8 (the
first 8 requests) and 32 (all 32); the llama_cpp executor also with `batch_invariant` (each
request decoded alone, exact) at 1 and 8. Reported: aggregate output tokens/s and the ratio
to llama-cpp-python; for llama_cpp, the time its prefills took and its mean decode step at
the full batch (the two terms that bound the aggregate); for torch, each decode step's bytes
read (weights once + every row's KV) against the machine's read bandwidth, measured here
with a large fp32 matrix–vector product.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.planning.machine import measure_machine
from kvdeck.runtime.resources import PASSAGE
from kvdeck.runtime.text.tokenizer import Tokenizer

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
TEXT = PASSAGE.read_text(encoding="utf-8")


def prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    ids = tok.encode(TEXT, add_bos=False)
    step = (len(ids) - PROMPT_TOKENS) // n
    return [[tok.bos_token_id] + ids[i * step:i * step + PROMPT_TOKENS - 1] for i in range(n)]


def run_llama(path: Path, reqs: list[list[int]], threads: int) -> list[float]:
    """Seconds per request, generated one after another with the high-level API."""
    from kvdeck.runtime.executors.llama_cpp_probe import open_llama

    llm = open_llama(path, n_ctx=512, n_threads=threads, verbose=False, seed=0)
    no_eos = {llm.token_eos(): float("-inf")}
    times = []
    for r in reqs:
        t = time.perf_counter()
        out = llm.create_completion(r, max_tokens=OUTPUT_TOKENS, temperature=0.0,
                                    logit_bias=no_eos)
        times.append(time.perf_counter() - t)
        assert out["usage"]["completion_tokens"] == OUTPUT_TOKENS
    return times


def run_engine(ex, reqs: list[list[int]], concurrency: int) -> dict:
    """Serve `reqs` with continuous batching at `concurrency`; seconds, output tokens, and
    each step's (seconds, bytes read, decode rows, prefill tokens)."""
    cfg = EngineConfig(kv_memory_bytes=512 << 20, knobs=Knobs(
        max_num_seqs=concurrency, max_num_batched_tokens=4096, chunk_size=4096,
        enable_prefix_caching=False, weight_format="measured"))
    e = Engine(cfg, ex)
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    records: list[StepRecord] = []
    e.recorder = records.append
    t = time.perf_counter()
    handles = [e.add_request(r, sp) for r in reqs]
    e.run_until_idle()
    seconds = time.perf_counter() - t
    e.check_integrity()
    assert all(h.num_output_tokens == OUTPUT_TOKENS for h in handles)
    decode_steps = [(r.dt, r.bytes_read) for r in records
                    if r.plan and all(c.num_new_tokens == 1 for c in r.plan)]
    full = [r.dt for r in records
            if r.plan and len(r.plan) == concurrency and all(c.num_new_tokens == 1
                                                             for c in r.plan)]
    return {"seconds": seconds, "tokens": len(reqs) * OUTPUT_TOKENS,
            "decode_steps": decode_steps, "full_batch_steps": full,
            "other_seconds": seconds - sum(s for s, _ in decode_steps)}


def llama_cpp_rows(path: Path, reqs: list[list[int]], threads: int,
                   llama_tps: float) -> list[dict]:
    """The llama_cpp executor, batched at 1, 8, 32 and batch-invariant at 1, 8."""
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    rows = []
    for exact, cases in ((False, ((1, 8), (8, 8), (32, 32))), (True, ((1, 8), (8, 8)))):
        ex = LlamaCppExecutor(path, threads=threads, n_parallel=32, batch_invariant=exact)
        for conc, n in cases:
            r = run_engine(ex, reqs[:n], conc)
            tps = r["tokens"] / r["seconds"]
            full = r["full_batch_steps"]
            row = {"executor": "llama_cpp", "mode": "exact" if exact else "batched",
                   "concurrency": conc, "requests": n, "tokens_per_s": tps,
                   "vs_llama_cpp": tps / llama_tps,
                   "prefill_and_mixed_s": r["other_seconds"],
                   "full_batch_step_ms": 1e3 * sum(full) / len(full) if full else None}
            rows.append(row)
            print(f"llama_cpp {row['mode']:>7} concurrency {conc:>2}: {tps:7.1f} tok/s = "
                  f"{row['vs_llama_cpp']:.2f}x llama-cpp-python; steps with prefill "
                  f"{row['prefill_and_mixed_s']:.1f} s, decode step of {conc} rows "
                  f"{row['full_batch_step_ms'] or 0:.1f} ms")
        ex.close()
    return rows


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    path = resolve_model(DEFAULT_MODEL)
    threads = torch.get_num_threads()
    tok = Tokenizer(path)
    reqs = prompts(tok, 32)
    bw, _ = measure_machine()
    print(f"model {path.name}; {len(reqs)} requests of {PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} "
          f"output tokens, greedy; {threads} threads; read bandwidth {bw / 1e9:.1f} GB/s")
    llama_times = run_llama(path, reqs, threads)
    llama_tps = OUTPUT_TOKENS / (sum(llama_times) / len(llama_times))
    print(f"llama-cpp-python, sequential: {llama_tps:.1f} output tokens/s")
    rows = llama_cpp_rows(path, reqs, threads, llama_tps)
    for dtype in ("fp32", "int8"):
        ex = TorchExecutor(path, device="cpu", dtype=dtype)
        for conc, n in ((1, 8), (8, 8), (32, 32)):
            r = run_engine(ex, reqs[:n], conc)
            tps = r["tokens"] / r["seconds"]
            steps = r["decode_steps"]
            floor = sum(b for _, b in steps) / bw
            actual = sum(s for s, _ in steps)
            row = {"executor": "torch", "dtype": dtype, "concurrency": conc, "requests": n,
                   "tokens_per_s": tps, "vs_llama_cpp": tps / llama_tps,
                   "decode_steps": len(steps),
                   "decode_step_ms": 1e3 * actual / max(len(steps), 1),
                   "roofline_floor_ms": 1e3 * floor / max(len(steps), 1),
                   "step_over_floor": actual / floor if floor else None}
            rows.append(row)
            print(f"torch {dtype:>4} concurrency {conc:>2}: {tps:7.1f} tok/s = "
                  f"{row['vs_llama_cpp']:.2f}x llama.cpp; decode step "
                  f"{row['decode_step_ms']:.1f} ms vs {row['roofline_floor_ms']:.1f} ms "
                  f"bandwidth floor ({row['step_over_floor']:.1f}x)")
        ex.close()
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "torch_vs_llama", "model": path.name, "threads": threads,
              "read_bandwidth_bytes_per_s": bw, "llama_cpp_tokens_per_s": llama_tps,
              "rows": rows}
    (out_dir / "torch_vs_llama.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
