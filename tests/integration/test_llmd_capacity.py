"""llm-d's capacity benchmark, reproduced in kind (`traces/llm-d-shared-prefix.toml` run on
the fleet of `profiles/fleet/llm-d-capacity.toml`): 4 replicas of Llama-70B at TP4 on H100
SXM, 83 groups × 3 questions behind 8,000-token system prompts, load stages 3 → 20 req/s.

llm-d measured at its top stage: precise prefix routing 5,650 output tok/s at TTFT p90
0.275 s, load-only routing 3,018 tok/s at 78 s, random 2,895 tok/s at 85 s. The policies
must rank the same way here. `make test` runs the shipped stages at 40 % of their length
(the rates and the workload's shape unchanged); `KVDECK_SOAK=full` (`make soak`) runs them
whole."""

from __future__ import annotations

import os
import re
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from kvdeck.runtime.cluster.replicas import ClusterConfig, replica_roles
from kvdeck.runtime.cluster.run import run_fleet
from kvdeck.runtime.resources import profiles_dir, sample_trace
from kvdeck.runtime.runs.trace import load_arrivals
from kvdeck.runtime.settings import load

FULL = os.environ.get("KVDECK_SOAK") == "full"


def stages_file(tmp_path: Path) -> Path:
    text = Path(str(sample_trace("llm-d-shared-prefix"))).read_text()
    if FULL:
        return Path(str(sample_trace("llm-d-shared-prefix")))
    out = tmp_path / "llm-d-shared-prefix.toml"
    out.write_text(re.sub(r"duration = (\d+)", lambda m: f"duration = {int(m[1]) * 0.4:g}",
                          text))
    return out


def top_stage(router: str, stages: Path) -> dict:
    """One router's fleet run on the stages: its summary figures and its last stage's
    (`top`)."""
    settings = load(str(profiles_dir().joinpath("fleet", "llm-d-capacity.toml")),
                    default_executor="sim")
    arrivals = load_arrivals(stages)
    result = run_fleet(settings, replica_roles(4, 0, 0), ClusterConfig(router=router),
                       arrivals)
    return {"cards": result["summary"]["cards"], "arrivals": len(arrivals),
            "num_requests": result["summary"]["num_requests"], "top": result["stages"][-1]}


def test_prefix_aware_routing_ranks_as_llm_d_measured(tmp_path):
    # The three runs are independent and single-threaded: one process each (spawned, not
    # forked from a process that holds torch's threads), so they share the machine's cores.
    routers = ("weighted", "least-loaded", "random")
    with ProcessPoolExecutor(len(routers), mp_context=get_context("spawn")) as pool:
        runs = pool.map(top_stage, routers, [stages_file(tmp_path)] * len(routers))
        top = dict(zip(routers, runs, strict=True))
    for stage in top.values():
        assert stage["cards"] == 16
        assert stage["num_requests"] == stage["arrivals"]
    tok = {r: s["top"]["output_tokens_per_s"] for r, s in top.items()}
    ttft = {r: s["top"]["ttft_p90_s"] for r, s in top.items()}
    # The order llm-d measured, on throughput and on TTFT p90, and the margins.
    assert tok["weighted"] > tok["least-loaded"] > tok["random"]
    assert ttft["weighted"] < ttft["least-loaded"] < ttft["random"]
    assert tok["weighted"] >= 1.5 * tok["random"]
    assert ttft["weighted"] * 20 <= ttft["random"]
