"""ITL target on a real model: the decoders' inter-token latency with and without it.

Model: Gemma 3 270M (Q4_K_M GGUF) on the torch executor (CPU, its default weights), whose
step-time model is fitted online from its own measured steps. Workload: four requests of
128 prompt tokens decoding 160 tokens each; two seconds in, a 3,000-token prompt arrives
(4 output tokens). Token budget 4,096 and chunk size 4,096, so without a target the long
prompt prefills in one step and every decoder waits for it. Printed side by side from one
run, without a target and with `itl_target_ms` 150 and 300 (above this CPU's four-row decode
step, so the target has room for prefill tokens): the decoders' ITL p50, p99 and max, the
long request's TTFT, and the mean predicted and measured time of the steps that carried a
chunk of the long prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.stats.metrics import Distribution

TARGETS = (0.0, 150.0, 300.0)


def run(ex: TorchExecutor, target_ms: float) -> dict:
    e = Engine(EngineConfig(kv_memory_bytes=512 << 20, knobs=Knobs(
        max_num_batched_tokens=4096, chunk_size=4096, itl_target_ms=target_ms,
        weight_format="dense")), ex)
    records: list[StepRecord] = []
    e.recorder = records.append
    arrivals = [Arrival(0.0, 128, 160, request_id=f"d{i}") for i in range(4)]
    arrivals.append(Arrival(2.0, 3000, 4, request_id="long"))
    result = run_arrivals(e, arrivals, vocab_size=ex.info.vocab_size)
    e.check_integrity()
    by_id = {r["request_id"]: r for r in result["requests"]}
    gaps = [x for i in range(4) for x in by_id[f"d{i}"]["itls"]]
    itls = Distribution.of(gaps)
    long_steps = [r for r in records if r.dt is not None and any(
        p.request_id == "long" and p.num_new_tokens > 1 for p in r.plan)]
    return {"itl_target_ms": target_ms, "itl_p50_s": itls.p50, "itl_p99_s": itls.p99,
            "itl_max_s": max(gaps), "long_ttft_s": by_id["long"]["ttft"],
            "long_prefill_steps": len(long_steps),
            "long_prefill_predicted_s": sum(r.predicted_s for r in long_steps) / len(long_steps),
            "long_prefill_measured_s": sum(r.dt for r in long_steps) / len(long_steps)}


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    path = resolve_model(DEFAULT_MODEL)
    ex = TorchExecutor(path, device="cpu")
    run(ex, 0.0)  # warm-up: the step model learns this machine's step times
    rows = []
    for target in TARGETS:
        r = run(ex, target)
        rows.append(r)
        print(f"itl_target_ms {target:>4.0f}: decoders' ITL p50 {1e3 * r['itl_p50_s']:.0f} ms, "
              f"p99 {1e3 * r['itl_p99_s']:.0f} ms, max {1e3 * r['itl_max_s']:.0f} ms; long "
              f"request TTFT {r['long_ttft_s']:.2f} s; its {r['long_prefill_steps']} prefill "
              f"steps {1e3 * r['long_prefill_predicted_s']:.0f} ms predicted, "
              f"{1e3 * r['long_prefill_measured_s']:.0f} ms measured on average", flush=True)
    ex.close()
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "itl_target", "model": path.name, "rows": rows}
    (out_dir / "itl_target.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
