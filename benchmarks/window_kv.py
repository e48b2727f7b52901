"""Freeing sliding-window KV: one 8,192-token prompt, then 32 greedy tokens, keeping every
layer's history and with `free_window_kv`.

Model: Gemma 3 270M (Q4_K_M GGUF; 3 full-attention and 15 sliding-window layers, window
512) on the torch executor (CPU, its default weights, fp16 KV), block size 16, prefix
caching off, chunks of 512. Printed side by side from one run: the KV the request holds
once its prompt is in (blocks of 18 layers against pages of 3: both in bytes), the mean
decode step time at that context (sliding-window layers then read 512 keys instead of
8,192), whether the tokens agree, and — from the engine's own page arithmetic — how many
such requests a 256 MiB pool holds at once either way.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

PROMPT_TOKENS = 8192
OUTPUT_TOKENS = 32
BUDGET = 256 << 20


def run(ex: TorchExecutor, free: bool) -> dict:
    e = Engine(EngineConfig(block_size=16, kv_memory_bytes=BUDGET, free_window_kv=free,
                            knobs=Knobs(kv_format="fp16", chunk_size=512,
                                        max_num_batched_tokens=512,
                                        enable_prefix_caching=False)), ex)
    records: list[StepRecord] = []
    e.recorder = records.append
    prompt = [2] + [300 + (37 * i) % 9000 for i in range(PROMPT_TOKENS - 1)]
    start = time.perf_counter()
    req = e.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS,
                                               ignore_eos=True))
    held = 0
    while e.has_work:
        e.step()
        if req.num_computed_tokens >= PROMPT_TOKENS and not held:
            held = e.kv.pool.num_held * e.kv.bytes_per_block  # the prompt is in
    wall = time.perf_counter() - start
    e.check_integrity()
    decode = [r.dt for r in records if r.dt and all(p.num_new_tokens == 1 for p in r.plan)]
    fits = e.kv.num_blocks // e.kv.pages_for(PROMPT_TOKENS + OUTPUT_TOKENS, 512)
    return {"free_window_kv": free, "tokens": req.output_token_ids, "wall_s": wall,
            "held_bytes": held, "decode_step_s": sum(decode) / len(decode),
            "decode_steps": len(decode), "pool_units": e.kv.num_blocks,
            "requests_that_fit": fits}


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    path = resolve_model(DEFAULT_MODEL)
    ex = TorchExecutor(path, device="cpu")
    try:
        keep, free = run(ex, False), run(ex, True)
    finally:
        ex.close()
    for r in (keep, free):
        unit = "pages" if r["free_window_kv"] else "blocks"
        print(f"{'freed' if r['free_window_kv'] else 'kept':>6}: {r['held_bytes'] / 2**20:6.1f} "
              f"MiB held at {PROMPT_TOKENS:,} tokens; decode {1e3 * r['decode_step_s']:.1f} ms "
              f"a step ({r['decode_steps']} steps); pool {r['pool_units']:,} {unit}, "
              f"{r['requests_that_fit']} such requests fit; run {r['wall_s']:.1f} s",
              flush=True)
    print(f"KV held kept/freed ×{keep['held_bytes'] / free['held_bytes']:.2f}; decode step "
          f"freed/kept ×{free['decode_step_s'] / keep['decode_step_s']:.2f}; same tokens: "
          f"{keep['tokens'] == free['tokens']}", flush=True)
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "window_kv", "model": path.name, "prompt_tokens": PROMPT_TOKENS,
              "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in (keep, free)],
              "same_tokens": keep["tokens"] == free["tokens"]}
    (out_dir / "window_kv.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
