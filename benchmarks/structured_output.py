"""Constrained decoding's throughput cost: the same eight prompts at concurrency 8, free and
constrained to a JSON schema.

Model: Gemma 3 270M (Q4_K_M GGUF) on the torch executor (CPU, its default weights) and on
the llama_cpp executor. Workload: eight chat prompts asking for a list, submitted together
(all eight decode in one batch), greedy, at most 160 output tokens each. Constrained: each
answer follows a schema of eight short strings (about 60-90 tokens); the grammar masks are
computed on a worker thread while the forward pass runs (`runtime/text/guided.py`). Printed side
by side from one run per executor: output tokens and wall time, then the mean time of the
steps that decoded all eight requests at once and the throughput it gives (constrained
answers end when their schema does, so whole-run rates would compare different batch
sizes), its constrained/free ratio, and how many constrained answers validate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.text.checks import AnswerCheck
from kvdeck.runtime.text.guided import GuideSpec
from kvdeck.runtime.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string", "maxLength": 12},
    "minItems": 8, "maxItems": 8}}, "required": ["items"], "additionalProperties": False}
PROMPTS = ["List eight fruits.", "List eight countries in Europe.", "Name eight animals.",
           "Eight colours, please.", "List eight programming languages.",
           "Name eight musical instruments.", "List eight cities in Asia.",
           "Name eight kinds of tree."]


def make_executor(kind: str, path: Path):
    if kind == "torch":
        from kvdeck.runtime.executors.torch import TorchExecutor

        return TorchExecutor(path, device="cpu")
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

    return LlamaCppExecutor(path, threads=2)


def run(ex, tok: Tokenizer, constrained: bool) -> dict:
    e = Engine(EngineConfig(kv_memory_bytes=256 << 20, knobs=Knobs(max_num_seqs=8)), ex,
               tokenizer=tok)
    records: list[StepRecord] = []
    e.recorder = records.append
    guide = GuideSpec("json_schema", json.dumps(SCHEMA)) if constrained else None
    reqs = []
    start = time.perf_counter()
    for text in PROMPTS:
        ids = tok.encode(tok.render_chat([{"role": "user", "content": text}]), add_bos=False)
        reqs.append(e.add_request(ids, SamplingParams(temperature=0.0, max_tokens=160,
                                                      ignore_eos=not constrained,
                                                      guide=guide)))
    e.run_until_idle()
    wall = time.perf_counter() - start
    e.check_integrity()
    tokens = sum(r.num_output_tokens for r in reqs)
    # Steps that decoded all eight at once: the cost at concurrency 8, whatever the
    # answers' lengths (constrained ones end when their schema does).
    steps = [r.dt for r in records if r.dt and len(r.plan) == 8
             and all(p.num_new_tokens == 1 for p in r.plan)]
    check = AnswerCheck("json_schema", json.dumps(SCHEMA))  # what answer checks judge by
    valid = sum(check.passes(r.output_text or "") for r in reqs)
    step = sum(steps) / len(steps)
    return {"constrained": constrained, "output_tokens": tokens, "wall_s": wall,
            "batch8_steps": len(steps), "batch8_step_s": step, "batch8_tokens_per_s": 8 / step,
            "valid_json": valid}


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    path = resolve_model(DEFAULT_MODEL)
    tok = Tokenizer(path)
    rows = []
    for kind in ("torch", "llama_cpp"):
        ex = make_executor(kind, path)
        run(ex, tok, True)  # warm-up: kernels, the grammar's view of the vocabulary
        free, guided = run(ex, tok, False), run(ex, tok, True)
        ex.close()
        for r in (free, guided):
            r["executor"] = kind
            rows.append(r)
            print(f"{kind:>9} {'constrained' if r['constrained'] else 'free':>11}: "
                  f"{r['output_tokens']} tokens in {r['wall_s']:.2f} s; decoding 8 at once "
                  f"({r['batch8_steps']} steps) {1e3 * r['batch8_step_s']:.0f} ms a step, "
                  f"{r['batch8_tokens_per_s']:.1f} tokens/s; {r['valid_json']}/8 valid JSON",
                  flush=True)
        ratio = guided["batch8_tokens_per_s"] / free["batch8_tokens_per_s"]
        print(f"{kind:>9} constrained/free throughput at concurrency 8: ×{ratio:.2f}",
              flush=True)
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "structured_output", "model": path.name, "concurrency": 8,
              "rows": rows}
    (out_dir / "structured_output.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
