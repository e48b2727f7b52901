"""`kvdeck plan` run as a user runs it: the chapter's burst on the reference card, its JSON,
the SVG plane, a model profile generated from a GGUF, and bad input in one sentence."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REFERENCE = ("plan", "--hardware", "rtx-pro-6000", "--model", "qwen3-8b", "--workload",
             "long-burst", "--kv-budget", "12", "--deadline", "7")


def kvdeck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "300"})


def test_the_reference_burst_gets_a_verdict_for_every_scheme_and_a_choice(tmp_path) -> None:
    svg = tmp_path / "plane.svg"
    r = kvdeck(*REFERENCE, "--svg", str(svg))
    assert r.returncode == 0, r.stderr
    schemes = json.loads(kvdeck(*REFERENCE, "--json").stdout)["schemes"]
    for s in schemes:  # every scheme has a row with its verdict
        row = next(line for line in r.stdout.splitlines()
                   if re.search(rf"│ {re.escape(s['scheme'])} +│", line))
        assert ("feasible" in row) if s["feasible"] else ("over by" in row or "missed" in row)
    assert "choice: " in r.stdout and "(chosen)" in r.stdout
    root = ET.parse(svg).getroot()  # well-formed, one point per scheme, two dashed limits
    tag = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{tag}circle")) == len(schemes)
    assert len([e for e in root.findall(f"{tag}line") if e.get("stroke-dasharray")]) == 2


def test_plan_json_carries_memory_time_feasibility_and_the_broken_limit() -> None:
    r = kvdeck(*REFERENCE, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["kv_budget_bytes"] == 12 * 2**30 and plan["deadline_s"] == 7
    names = [s["scheme"] for s in plan["schemes"]]
    assert {"baseline", "shared prefix", "q8_0 KV", "q4_0 KV", "spec dflash-qwen3-8b",
            "shared prefix + q8_0 KV + spec dflash-qwen3-8b"} <= set(names)
    assert any(s["weight_offload"] for s in plan["schemes"])
    for s in plan["schemes"]:
        assert isinstance(s["memory_bytes"], int) and s["memory_bytes"] > 0
        assert s["ttft_s"] > 0 and s["completion_s"] > s["ttft_s"]
        assert s["feasible"] == (s["broken_limit"] is None)
        if not s["feasible"]:
            assert set(s["broken_limit"].split(", ")) <= {"memory", "deadline"}
            assert all(b["over_by"] > 0 for b in s["broken"])
    chosen = next(s for s in plan["schemes"] if s["scheme"] == plan["choice"])
    assert chosen["feasible"] and chosen["memory_bytes"] <= 12 * 2**30
    assert chosen["completion_s"] <= 7
    assert plan["figures"]["formats"]["bf16"]["crossover_batch"] == 13


def test_a_model_profile_from_a_gguf_header(gemma_path: Path) -> None:
    r = kvdeck("plan", "--model", str(gemma_path), "--workload", "short-chat", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["figures"]["timing"] == "roofline"  # no fitted step for this card
    assert plan["figures"]["local_layers"] == 15 and plan["figures"]["sliding_window"] == 512


def test_bad_input_gets_one_sentence() -> None:
    for args, message in [
        (("--hardware", "h900"), "Unknown hardware profile 'h900'; available: "),
        (("--workload", "nope"), "Unknown workloads profile 'nope'; available: "),
        (("--kv-budget", "-3"), "--kv-budget must be a number from"),
        (("--timing", "magic"), "--timing must be auto, measured, fit or roofline, got 'magic'."),
        (("--draft", "ngram", "--draft", "nope"), "Unknown drafts profile 'nope'"),
        (("--hardware", "h200", "--timing", "fit"),
         "Model profile qwen3-8b has no fitted step model for h200"),
    ]:
        r = kvdeck("plan", *args)
        assert r.returncode == 2, (args, r.stdout)
        assert message in r.stderr and "Traceback" not in r.stderr


def test_scenarios_run_from_the_command_line() -> None:
    listed = json.loads(kvdeck("scenario", "list", "--json").stdout)
    assert {"comprehensive", "retention-break-even"} <= {s["name"] for s in listed}
    r = kvdeck("scenario", "run", "comprehensive")
    assert r.returncode == 0, r.stderr
    assert re.search(r"│ choice +│ +D │ +D │.*holds", r.stdout)
    data = json.loads(kvdeck("scenario", "run", "comprehensive", "--json").stdout)
    assert all(f["holds"] for f in data["figures"]) and data["note"]
    bad = kvdeck("scenario", "run", "nope")
    assert bad.returncode == 2 and bad.stderr.startswith("error: No scenario 'nope';")
    assert "Traceback" not in bad.stderr


def test_a_scenario_s_chosen_scheme_runs_recorded_for_the_console(tmp_path) -> None:
    r = kvdeck("scenario", "run", "comprehensive", "--record", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "ran shared prefix + spec dflash-qwen3-8b in the sim" in " ".join(r.stdout.split())
    replayed = kvdeck("replay", str(tmp_path / "run"), "--summary", "--json")
    assert json.loads(replayed.stdout)["statuses"] == {"finished_length": 16}
    other = kvdeck("scenario", "run", "retention-break-even", "--record", str(tmp_path / "x"))
    assert other.returncode == 2 and "without an engine run to open" in other.stderr


def test_plan_takes_tensor_parallelism_for_a_model_one_card_cannot_hold(tmp_path) -> None:
    """Llama-70B in BF16 (141 GB) on H200 cards (141 GB, 127 GB at 90 %): one card cannot
    hold it, so the plan goes over layouts with cards as a cost and takes the fewest cards
    that meet a chat at one request per second, saying why."""
    workload = tmp_path / "chat.toml"
    workload.write_text('name = "chat-1rps"\nprompt_tokens = 2048\noutput_tokens = 256\n'
                        'deadline_s = 7.0\narrival = "poisson"\nrate_per_s = 1.0\n'
                        'num_requests = 64\n')
    args = ("plan", "--hardware", "h200", "--model", "llama-70b", "--workload", str(workload))
    r = kvdeck(*args)
    assert r.returncode == 0, r.stderr
    assert "Cheapest feasible layout: TP2, 2 h200 cards" in r.stdout
    assert "llama-70b's 141 GB of weights do not fit 1 h200 card(s) at 90% of their memory" \
        in " ".join(r.stdout.split())
    data = json.loads(kvdeck(*args, "--json").stdout)
    by_name = {x["layout"]: x for x in data["layouts"]}
    assert by_name["TP1"]["problem"].startswith("TP1 on h200 cannot hold llama-70b")
    assert by_name["TP2"]["choice"] and by_name["TP2"]["cards"] == 2
    assert by_name["TP4×PP2"]["pipeline_bubble"] > 0
    # More cards cost more card-seconds for the same work: TP2 is the cheapest.
    assert by_name["TP2"]["card_s_per_good"] < by_name["TP4"]["card_s_per_good"]
    assert data["plan"]["schemes"]
    chosen = json.loads(kvdeck(*args, "--json", "--layouts", "TP2,tp4xpp2,PP2×TP4").stdout)
    assert [x["layout"] for x in chosen["layouts"]] == ["TP2", "TP4×PP2"]
    bad = kvdeck(*args, "--layouts", "TP3")
    assert bad.returncode == 2 and "--layouts takes auto or layouts like TP1,TP2,TP4xPP2" in \
        bad.stderr
    budget = kvdeck(*args, "--kv-budget", "10")
    assert budget.returncode == 2 and "--kv-budget is one card's" in budget.stderr


def test_a_model_that_fits_one_card_plans_on_one_card_as_before() -> None:
    one = json.loads(kvdeck(*REFERENCE, "--json").stdout)
    explicit = json.loads(kvdeck(*REFERENCE, "--json", "--layouts", "TP1").stdout)
    assert one == explicit and "layouts" not in one


def test_graph_replay_memory_comes_out_of_the_derived_kv_budget() -> None:
    """The chapter counts graph replay buffers outside the KV budget (`M_u`): without
    --kv-budget the planner leaves them out of what the card gives KV, and says how much."""
    base = ("plan", "--hardware", "rtx-pro-6000", "--model", "qwen3-8b", "--workload",
            "long-burst", "--json")
    plain = json.loads(kvdeck(*base).stdout)
    shaped = json.loads(kvdeck(*base, "--graph-buckets", "1,2,4,8,16").stdout)
    reserve = shaped["figures"]["graph_pool_bytes"]
    # 16 rows at 8,447 positions (the last output is never attended): Qwen3-8B's 32 query
    # heads and 8 KV heads of 128, one layer's keys and values gathered, bf16.
    assert reserve == 16 * (2 * (3 * 32 * 128 + 2 * 8 * 128 * 8447) + 8 * 32 * 8447)
    assert plain["figures"]["graph_pool_bytes"] == 0
    assert plain["kv_budget_bytes"] - shaped["kv_budget_bytes"] == reserve
    text = kvdeck(*base[:-1], "--graph-buckets", "1,2,4,8,16").stdout
    assert f"CUDA graphs at 1,2,4,8,16 rows: {reserve / 2**20:,.1f} MiB kept for replay" in text


def test_the_graph_pool_estimate_against_the_pool_measured_on_an_h200() -> None:
    """`graph_pool_bytes` against the one pool measured so far: the torch executor on an
    NVIDIA H200, Gemma 3 270M's shape in bf16, graphs up to 64 rows at 96 positions
    (`benchmarks/cuda_graphs.py`, docs/executors.md): 6.7 MiB."""
    from kvdeck.runtime.planning.profiles import ModelProfile
    from kvdeck.runtime.planning.step_time import graph_pool_bytes

    gemma = ModelProfile.load("gemma3-270m")
    assert (gemma.num_heads, gemma.num_kv_heads, gemma.head_dim) == (4, 1, 256)
    assert abs(graph_pool_bytes(gemma, 64, 96) / (6.7 * 2**20) - 1) < 0.05
