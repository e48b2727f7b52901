"""CUDA graphs against eager decode steps on the torch executor (needs CUDA: elsewhere it
says so and stops).

Model: random weights in Gemma 3 270M's shape (18 layers, hidden 640, 4 query heads and
one KV head of 256, FFN 2,048, a 262,144-token head, window 512), written as a GGUF, run
in bf16 with bf16 KV: a small model, where a decode step is mostly kernel launches — the
case graphs are for. For each batch size, `B` requests of 32 prompt tokens decode 64
tokens each, eager and with `--graph-buckets 1,2,4,8,16,32,64` in turns (3 rounds each,
interleaved); printed: the median decode step time of each and the ratio (graphs /
eager), and whether every request's tokens agree.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import torch

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.executors.torch import TorchExecutor
from tests.factories import TinySpec, write_tiny_gguf

BATCHES = (1, 4, 16, 32, 64)
BUCKETS = "1,2,4,8,16,32,64"
ROUNDS = 3
SHAPE = TinySpec(arch="gemma3", num_layers=18, hidden=640, num_heads=4, num_kv_heads=1,
                 head_dim=256, ffn=2048, vocab=262_144, context=4096, sliding_window=512)


def decode_steps(ex: TorchExecutor, batch: int, seed: int) -> tuple[list[float], list]:
    """Decode step times and every request's tokens for `batch` requests at once."""
    e = Engine(EngineConfig(block_size=16, num_blocks=batch * 8 + 8,
                            knobs=Knobs(kv_format="bf16", max_num_seqs=batch,
                                        enable_prefix_caching=False)), ex)
    records: list[StepRecord] = []
    e.recorder = records.append
    for i in range(batch):
        e.add_request([2] + [(seed * 7919 + i * 131 + j * 17) % 200_000 + 10 for j in range(31)],
                      SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    e.run_until_idle()
    e.check_integrity()
    steps = [r.dt for r in records if r.dt and r.num_decode == batch and not r.num_prefill]
    return steps, [r.output_token_ids for r in sorted(e.completed, key=lambda r: r.request_id)]


def main(out_dir: Path = Path("bench-results")) -> dict | None:
    print(__doc__.strip().splitlines()[0])
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing measured")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return measure(write_tiny_gguf(Path(tmp) / "gemma3-270m-shape.gguf", SHAPE), out_dir)


def measure(path: Path, out_dir: Path) -> dict:
    eager = TorchExecutor(path, device="cuda", dtype="bf16")
    graphs = TorchExecutor(path, device="cuda", dtype="bf16", graph_buckets=BUCKETS)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}")
    print(f"{'rows':>5} {'eager ms':>9} {'graphs ms':>10} {'ratio':>6}  tokens")
    rows = []
    for batch in BATCHES:
        times: dict[str, list[float]] = {"eager": [], "graphs": []}
        agree = True
        for r in range(ROUNDS):
            a, tokens_a = decode_steps(eager, batch, r)
            b, tokens_b = decode_steps(graphs, batch, r)
            times["eager"] += a
            times["graphs"] += b
            agree &= tokens_a == tokens_b
        e_ms, g_ms = (statistics.median(times[k]) * 1e3 for k in ("eager", "graphs"))
        rows.append({"rows": batch, "eager_ms": e_ms, "graphs_ms": g_ms,
                     "ratio": g_ms / e_ms, "tokens_agree": agree})
        print(f"{batch:>5} {e_ms:>9.2f} {g_ms:>10.2f} {g_ms / e_ms:>6.2f}  "
              f"{'same' if agree else 'differ'}")
    print(graphs.graphs.lines()[0])
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rows": rows, "graphs": graphs.graphs.lines()[0]}
    out_dir.mkdir(exist_ok=True)
    (out_dir / "cuda_graphs.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
