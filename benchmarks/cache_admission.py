"""Prefix-cache admission: cache every completed block, or only prefixes seen k times.

Model: the sim executor's Qwen3-8B on the RTX PRO 6000 profile (fitted step model, BF16 KV,
16 GiB pool), no host tier, `lru` eviction. Requests: the repository's 500-request excerpt
of the Mooncake FAST'25 conversation trace (shared prefixes by hash id, 512 tokens per id)
at a quarter of its arrival rate. Printed side by side from one run, at prefix-cache sizes
of 1,000 and 4,000 blocks: `cache_admission_k` 1 (every block, the default) against 2 and 3
(a block enters only when its prefix was in the prompts of that many of the last 1,024
admitted requests): token hit rate, evictions, TTFT p50/p99/mean.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.executors.sim import SimExecutor
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import load_arrivals, resolve_trace

GIB = 1 << 30
TRACE = "mooncake-conversation"
TIME_SCALE = 4.0
CAPACITIES = (1000, 4000)
KS = (1, 2, 3)


def run(capacity: int, k: int) -> dict:
    ex = SimExecutor(seed=0)
    knobs = Knobs(max_num_batched_tokens=8192, chunk_size=2048, kv_format="bf16",
                  prefix_cache_capacity=capacity, cache_admission_k=k)
    engine = Engine(EngineConfig(kv_memory_bytes=16 * GIB, knobs=knobs), ex)
    arrivals = load_arrivals(resolve_trace(TRACE), time_scale=TIME_SCALE)
    s = run_arrivals(engine, arrivals, vocab_size=ex.info.vocab_size)["summary"]
    engine.check_integrity()
    return {"capacity": capacity, "k": k, "hit_rate": s["prefix_hit_rate"],
            "evictions": s["num_evictions"], "ttft_p50_s": s["ttft_s"]["p50"],
            "ttft_p99_s": s["ttft_s"]["p99"], "ttft_mean_s": s["ttft_s"]["mean"]}


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    rows = []
    for capacity in CAPACITIES:
        for k in KS:
            r = run(capacity, k)
            rows.append(r)
            print(f"cache {capacity:>5} blocks, admit k={k}: hit rate {r['hit_rate']:.1%}, "
                  f"{r['evictions']:,} evictions, TTFT p50 {r['ttft_p50_s']:.2f} s, p99 "
                  f"{r['ttft_p99_s']:.2f} s, mean {r['ttft_mean_s']:.2f} s", flush=True)
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "cache_admission", "trace": TRACE, "time_scale": TIME_SCALE,
              "rows": rows}
    (out_dir / "cache_admission.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
