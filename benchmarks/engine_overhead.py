"""Engine overhead per iteration: schedule + KV bookkeeping + update, with a zero-cost executor.

N requests (64, 256, 1024) each hold a 2K-token context (16-token blocks, prefix caching on,
a 512-token prefix shared by all) and decode one token per iteration. The sim executor's step
time is set to zero, so the figure is the engine's own CPU cost. Target: ≤ 1 ms per iteration
at 256 running requests on a 2-core machine. Snapshot building is timed separately, each
snapshot right after a step (every running request changed, blocks entered the prefix
cache), as the engine thread builds them for the console and /metrics at up to 10 per
second. Target: ≤ 2 ms per snapshot at 256 running requests.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.views.snapshot import snapshot_of

CONTEXT = 2048
SHARED = 512
BLOCK = 16
TARGET_MS = 1.0
SNAPSHOT_TARGET_MS = 2.0


def build(n: int) -> Engine:
    knobs = Knobs(max_num_batched_tokens=max(8192, n), max_num_seqs=n, chunk_size=CONTEXT)
    blocks = n * (CONTEXT // BLOCK + 8) + 64
    cfg = EngineConfig(block_size=BLOCK, num_blocks=blocks, knobs=knobs)
    sim = SimConfig(fixed_ms=0.0, per_token_us=0.0, per_pair_ns=0.0)
    e = Engine(cfg, SimExecutor(sim))
    prefix = list(range(10, 10 + SHARED))
    for i in range(n):
        prompt = prefix + [(i * 7919 + j) % 30_000 + 3 for j in range(CONTEXT - SHARED - 64)]
        e.add_request(prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))
    # Prefill everyone; measure only steady-state decode iterations.
    e.step()
    while any(not r.is_decoding for r in e.scheduler.running) or e.scheduler.waiting:
        e.step()
    return e


def measure(n: int, steps: int) -> dict:
    e = build(n)
    assert len(e.scheduler.running) == n
    # The steady-state heap is frozen out of the cyclic collector, as a long-running server
    # does after warm-up (vLLM calls gc.freeze()): at 1,024 running a full collection of it
    # takes tens of ms, and whether one lands in the timed steps swung the figure between
    # about 3.5 and 5 ms per iteration from run to run.
    gc.collect()
    gc.freeze()
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            e.step()
        per_step = (time.perf_counter() - t0) / steps
        snap = 0.0
        for _ in range(20):
            e.step()
            t0 = time.perf_counter()
            snapshot_of(e)
            snap += (time.perf_counter() - t0) / 20
    finally:
        gc.unfreeze()
    e.check_integrity()
    return {"running": n, "steps": steps, "ms_per_iteration": per_step * 1e3,
            "iterations_per_s": 1 / per_step, "ms_per_snapshot": snap * 1e3,
            "blocks": e.kv.num_blocks}


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    print(f"zero-cost sim executor; {CONTEXT}-token contexts, {SHARED} shared; "
          f"block size {BLOCK}; prefix caching on")
    rows = [measure(n, steps) for n, steps in ((64, 400), (256, 200), (1024, 60))]
    print(f"{'running':>8} {'ms/iter':>9} {'iter/s':>9} {'vs 1 ms':>8} {'ms/snapshot':>12}")
    for r in rows:
        print(f"{r['running']:>8} {r['ms_per_iteration']:>9.3f} {r['iterations_per_s']:>9.0f} "
              f"{r['ms_per_iteration'] / TARGET_MS:>7.2f}x {r['ms_per_snapshot']:>12.2f}")
    at256 = next(r for r in rows if r["running"] == 256)
    verdict = "meets" if at256["ms_per_iteration"] <= TARGET_MS else "misses"
    print(f"at 256 running: {at256['ms_per_iteration']:.3f} ms/iteration, {verdict} the "
          f"{TARGET_MS} ms target")
    verdict = "meets" if at256["ms_per_snapshot"] <= SNAPSHOT_TARGET_MS else "misses"
    print(f"at 256 running: {at256['ms_per_snapshot']:.3f} ms/snapshot, {verdict} the "
          f"{SNAPSHOT_TARGET_MS} ms target (at 10 snapshots/s: "
          f"{at256['ms_per_snapshot'] / 100:.1%} of the engine thread)")
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "engine_overhead", "rows": rows, "target_ms_at_256": TARGET_MS,
              "snapshot_target_ms_at_256": SNAPSHOT_TARGET_MS}
    (out_dir / "engine_overhead.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
