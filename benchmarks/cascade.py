"""A confidence cascade against each of its models alone: what a good answer costs.

Models: Qwen2.5-Coder-0.5B-Instruct and 1.5B-Instruct (the `draft-models` extra), served
together by `kvdeck serve --model ... --model ... --cascade 0.5B,1.5B` on the llama_cpp
executor (started as a user starts it, on 127.0.0.1). Workload: the shipped checked question
set (70 questions, `runtime/text/questions.jsonl`), greedy, at concurrency 4, asked of the
0.5B, the 1.5B and the cascade one after another (`kvdeck bench --questions`). Printed: each
arm's accuracy, escalations and accelerator seconds per good answer (the server's
`kvdeck:device_busy_seconds` over the arm), and the cascade's figures against the 1.5B's;
written to `bench-results/cascade.json`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.servers import serve_process

SMALL, LARGE = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
OUT = Path("bench-results/cascade.json")


def main() -> None:
    with serve_process("--model", SMALL, "--model", LARGE, "--cascade", f"{SMALL},{LARGE}",
                       start_timeout_s=300) as srv:
        run = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "bench",
                              "--questions", "checked-questions", "--concurrency", "4",
                              "--models", f"{SMALL},{LARGE},cascade", "--url", srv.url,
                              "--json"], capture_output=True, text=True, check=True)
    result = json.loads(run.stdout)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    arms = {a["model"]: a for a in result["arms"]}
    print("Cascade (0.5B → 1.5B, min-prob < 0.5) on the shipped checked questions:")
    for name, a in arms.items():
        per_good = a["accelerator_s_per_good_answer"]
        escalated = "" if a["escalated"] is None else \
            f", escalated {a['escalated']:.0f} ({a['escalation_rate']:.0%})"
        print(f"  {name:20} {a['good']}/{a['questions']} good ({a['accuracy']:.1%})"
              f"{escalated}, {per_good:.3f} accelerator s per good answer")
    c, big = arms["cascade"], arms[LARGE]
    print(f"  cascade vs {LARGE}: accuracy {100 * (c['accuracy'] - big['accuracy']):+.1f} "
          f"points, cost per good answer "
          f"{c['accelerator_s_per_good_answer'] / big['accelerator_s_per_good_answer']:.2f}×")


if __name__ == "__main__":
    main()
