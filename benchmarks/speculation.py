"""Speculative decoding on the torch executor: where it wins, n-gram and draft model.

N-gram half. Model: Gemma 3 270M (the embedded default), fp32 compute, dense weights, this
machine's threads. Two prompt sets, 8 prompts each, 64 greedy output tokens per request:

- *edit*: code and text the model is asked to repeat with a change (its output copies long
  runs of its input: the case prompt lookup is made for);
- *fresh*: open questions (little for a lookup to find).

Draft-model half. Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct
(the `draft-models` extra), both fp32 dense; *code*: 8 code-completion prompts, 32 greedy
tokens each.

Each set runs at concurrency 1 (one request at a time) and 8 (all at once), with speculation
off, then on (k = 4) at adaptive draft length and at fixed length, in one process run, side
by side:
output tokens/s (wall), per-token latency ΣT/ΣN over each request's decode (its decode
time over the tokens it generated), target forward passes per output token, and for
speculation the acceptance rate and tokens per verify pass. Outputs are checked token for
token against speculation off (greedy is lossless).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.errors import ModelNotFoundError
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.text.tokenizer import Tokenizer

EDIT = [
    "Rewrite this function with the variable renamed from x to value:\n"
    "def scale(x):\n    if x < 0:\n        x = -x\n    x = x * 2\n    return x + 1\n\n"
    "def scale(value):\n",
    "Copy the list, adding one to each number: 3, 8, 13, 18, 23, 28, 33, 38, 43, 48.\n"
    "Answer: 4, 9, 14, 19,",
    "Repeat the sentence exactly: The committee will meet on Tuesday at noon in the main "
    "hall to review the annual budget and the hiring plan.\nRepeated: The committee will",
    "Fix the typo and repeat the paragraph: Paged attention stores the KV cache in fixed "
    "size blocks so that memory is allocated on demand and shared between requests.\n"
    "Fixed: Paged attention stores",
    "<ul>\n<li>apples</li>\n<li>pears</li>\n<li>plums</li>\n<li>figs</li>\n</ul>\n"
    "The same list in upper case:\n<ul>\n<li>",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(",
    "SELECT name, age FROM users WHERE age > 30;\nSELECT name, age FROM users WHERE age >",
    "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2, 3]\nd = [",
]
FRESH = [
    "Why is the sky blue? Explain it to a child.",
    "Write a short poem about the sea at night.",
    "What are three uses of a paperclip?",
    "Describe the taste of a lemon.",
    "How does a bicycle stay upright?",
    "Give advice to someone starting to learn the piano.",
    "What makes a good cup of coffee?",
    "Tell a story about a lost key.",
]
CODE = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import numpy as np\n\ndef normalize(x):\n    \"\"\"Scale x to unit length.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "# Sort a list of dictionaries by the 'age' key\npeople = [{'name': 'a', 'age': 3}]\n",
    "def is_prime(n: int) -> bool:\n",
    "function debounce(fn, ms) {\n",
    "SELECT customers.name, COUNT(orders.id)\nFROM customers\n",
]
OUTPUT = 64
CODE_OUTPUT = 32


def run(ex: TorchExecutor, reqs: list[list[int]], concurrency: int, method: str,
        length: str = "adaptive", output: int = OUTPUT) -> dict:
    e = Engine(EngineConfig(knobs=Knobs(speculative_method=method, num_speculative_tokens=4,
                                        draft_length=length, weight_format="dense",
                                        max_num_batched_tokens=512, chunk_size=256)), ex)
    sp = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    t0 = time.perf_counter()
    steps = 0
    for start in range(0, len(reqs), concurrency):
        for i, prompt in enumerate(reqs[start:start + concurrency], start):
            e.add_request(prompt, sp, request_id=f"r{i}")
        while e.has_work:
            if e.step() is not None:
                steps += 1
    wall = time.perf_counter() - t0
    done = sorted(e.completed, key=lambda r: int(r.request_id[1:]))
    decode = sum(r.token_times[-1] - r.first_token_time for r in done)
    tokens = sum(len(r.output_token_ids) - 1 for r in done)
    passes = sum(len(set(r.token_times)) for r in done)
    s = e.scheduler.spec
    return {"concurrency": concurrency, "method": method if method == "off" else
            f"{method} {length}", "wall_s": wall,
            "tokens_per_s": sum(len(r.output_token_ids) for r in done) / wall,
            "ms_per_token": 1e3 * decode / tokens, "steps": steps,
            "passes_per_token": passes / sum(len(r.output_token_ids) for r in done),
            "acceptance": s.acceptance_rate, "tokens_per_pass": s.mean_accepted_length,
            "draft_share": s.draft_seconds / s.draft_step_seconds if s.draft_step_seconds
            else 0.0, "outputs": [list(r.output_token_ids) for r in done]}


HEADER = (f"{'set':>6} {'conc':>4} {'method':>14} {'tok/s':>7} {'ms/tok':>7} "
          f"{'passes/tok':>10} {'accept':>7} {'tok/pass':>8} {'draft':>6} {'speedup':>8}")


def compare(ex: TorchExecutor, name: str, reqs: list[list[int]], method: str,
            output: int, rows: list[dict]) -> None:
    """Speculation off, adaptive and fixed at concurrency 1 and 8, printed side by side;
    greedy outputs must agree token for token."""
    for conc in (1, 8):
        off = run(ex, reqs, conc, "off", output=output)
        runs = [off, run(ex, reqs, conc, method, output=output),
                run(ex, reqs, conc, method, "fixed", output=output)]
        for r in runs[1:]:
            assert r["outputs"] == off["outputs"], "speculative greedy output differs"
        for r in runs:
            r["set"] = name
            r["speedup"] = r["tokens_per_s"] / off["tokens_per_s"]
            print(f"{name:>6} {conc:>4} {r['method']:>14} {r['tokens_per_s']:>7.1f} "
                  f"{r['ms_per_token']:>7.1f} {r['passes_per_token']:>10.2f} "
                  f"{r['acceptance']:>7.0%} {r['tokens_per_pass']:>8.2f} "
                  f"{r['draft_share']:>6.0%} {r['speedup']:>7.2f}x", flush=True)
            rows.append({k: v for k, v in r.items() if k != "outputs"})


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    path = resolve_model(DEFAULT_MODEL)
    tok = Tokenizer(path)
    ex = TorchExecutor(path, device="cpu", dtype="fp32")
    print(f"{path.name}, torch fp32 dense weights, {OUTPUT} greedy tokens per request, "
          "8 prompts per set, ngram k = 4")
    print(HEADER)
    rows: list[dict] = []
    for name, texts in (("edit", EDIT), ("fresh", FRESH)):
        compare(ex, name, [tok.encode(t) for t in texts], "ngram", OUTPUT, rows)
    result = {"benchmark": "speculation", "model": path.name, "rows": rows}
    try:
        target, draft = resolve_model("qwen2.5-coder-1.5b"), resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as e:
        print(f"draft-model half skipped: {e}")
    else:
        ex.close()
        tok = Tokenizer(target)
        ex = TorchExecutor(target, device="cpu", dtype="fp32", draft_model=draft)
        print(f"\n{target.name} drafted by {draft.name}, torch fp32 dense weights, "
              f"{CODE_OUTPUT} greedy tokens per request, 8 prompts, draft k = 4")
        print(HEADER)
        drows: list[dict] = []
        compare(ex, "code", [tok.encode(t) for t in CODE], "draft", CODE_OUTPUT, drows)
        result["draft"] = {"target": target.name, "draft": draft.name, "rows": drows}
    out_dir.mkdir(exist_ok=True)
    (out_dir / "speculation.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
