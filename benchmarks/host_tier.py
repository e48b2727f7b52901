"""Prefix retention with a host tier: `lru` against `value` eviction on the Mooncake trace.

Model: the sim executor's Qwen3-8B on the RTX PRO 6000 profile (fitted step model, BF16 KV,
16 GiB pool, PCIe Gen5 x16 at 64 GB/s per direction). Requests: the repository's 500-request
excerpt of the Mooncake FAST'25 conversation trace (prompts 14.2K tokens on average, shared
prefixes by hash id, 512 tokens per id) at a quarter of its arrival rate (`time_scale` 4), every
output token generated. Printed side by side, from one run, at two prefix-cache sizes (the
`prefix_cache_capacity` knob, in 16-token blocks):

- without a host tier (evicted blocks are dropped) and with a 32 GiB one (evicted blocks are
  demoted, hits on them promote them back: host hits);
- `lru` and `value` eviction, `value` ranking by `V_h = p_h·(T_r − T_f) − T_m` per byte
  with `T_f`, `T_m` one copy over the link (docs/architecture.md, "Prefix retention");

each with the token hit rate (device and host hits), TTFT p50/p99 and the mean, and the
ratio of TTFT p50 to `lru` without a host tier at the same cache size. Then, with the host
tier, `lru` and 4,000 blocks: `recompute`, `swap` and `auto` preemption side by side
(preemptions, swaps, TTFT, TPOT, makespan). The 16 GiB pool holds about eight of these
requests, so under lazy reservation growing outputs preempt often: recompute re-runs a
14K-token prefill, a swap moves ~2 GB over the link.
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
HOST = (0, 32 * GIB)


def run(capacity: int, policy: str, host_bytes: int, preemption: str = "recompute") -> dict:
    ex = SimExecutor(seed=0)
    knobs = Knobs(max_num_batched_tokens=8192, chunk_size=2048, kv_format="bf16",
                  prefix_cache_capacity=capacity, eviction_policy=policy,
                  preemption=preemption)
    engine = Engine(EngineConfig(kv_memory_bytes=16 * GIB, host_kv_memory_bytes=host_bytes,
                                 knobs=knobs), ex)
    arrivals = load_arrivals(resolve_trace(TRACE), time_scale=TIME_SCALE)
    s = run_arrivals(engine, arrivals, vocab_size=ex.info.vocab_size)["summary"]
    engine.check_integrity()
    query = s["prefix_query_tokens"] or 1
    return {"capacity": capacity, "policy": policy, "host_gib": host_bytes / GIB,
            "hit_rate": s["prefix_hit_rate"],
            "device_hit_rate": s["prefix_device_hit_tokens"] / query,
            "host_hit_rate": s["prefix_host_hit_tokens"] / query,
            "demotions": s["prefix_demotions"], "evictions": s["num_evictions"],
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
            "ttft_mean_s": s["ttft_s"]["mean"], "makespan_s": s["makespan_s"],
            "preemption": preemption, "preemptions": engine.scheduler.num_preemptions,
            "swaps": engine.scheduler.num_swapped, "tpot_p50_s": s["tpot_s"]["p50"],
            "throughput_rps": s["completion_throughput_rps"]}


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    print(f"sim Qwen3-8B @ RTX PRO 6000, {TRACE} excerpt (500 requests) at time scale "
          f"{TIME_SCALE:g}, 16 GiB KV pool")
    rows = [run(c, p, h) for c in CAPACITIES for h in HOST for p in ("lru", "value")]
    print(f"{'cache':>6} {'host':>6} {'policy':>6} {'hit %':>6} {'dev %':>6} {'host %':>6} "
          f"{'demoted':>8} {'TTFT p50':>9} {'p99':>8} {'mean':>8} {'p50 vs lru':>10}")
    for r in rows:
        base = next(b for b in rows if b["capacity"] == r["capacity"] and b["host_gib"] == 0
                    and b["policy"] == "lru")
        print(f"{r['capacity']:>6} {r['host_gib']:>4.0f}Gi {r['policy']:>6} "
              f"{r['hit_rate']:>6.1%} {r['device_hit_rate']:>6.1%} {r['host_hit_rate']:>6.1%} "
              f"{r['demotions']:>8,} {r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>7.2f}s "
              f"{r['ttft_mean_s']:>7.3f}s {r['ttft_p50_s'] / base['ttft_p50_s']:>9.3f}x")
    print("\npreemption with a 32 GiB host tier, lru, cache 4,000 blocks:")
    modes = [next(r for r in rows if r["capacity"] == 4000 and r["host_gib"] == 32
                  and r["policy"] == "lru")]
    modes += [run(4000, "lru", 32 * GIB, m) for m in ("swap", "auto")]
    print(f"{'mode':>10} {'preempt':>8} {'swaps':>6} {'TTFT p50':>9} {'p99':>8} "
          f"{'TPOT p50':>9} {'makespan':>9} {'req/s':>6} {'p50 vs recompute':>16}")
    for r in modes:
        print(f"{r['preemption']:>10} {r['preemptions']:>8,} {r['swaps']:>6,} "
              f"{r['ttft_p50_s']:>8.2f}s {r['ttft_p99_s']:>7.1f}s {r['tpot_p50_s'] * 1e3:>7.1f}ms "
              f"{r['makespan_s']:>8.0f}s {r['throughput_rps']:>6.3f} "
              f"{r['ttft_p50_s'] / modes[0]['ttft_p50_s']:>15.3f}x")
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "host_tier", "trace": TRACE, "time_scale": TIME_SCALE, "rows": rows,
              "preemption": modes}
    (out_dir / "host_tier.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
