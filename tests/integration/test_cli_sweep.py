"""`kvdeck sweep` on the sim over the Mooncake conversation trace: goodput peaks at a knee,
falls past it without a cap, and holds with the cap the sweep recommends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from kvdeck.runtime.planning.sweep import offered_rate
from kvdeck.runtime.runs.trace import load_arrivals


def kvdeck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "COLUMNS": "160"})


def test_sweep_finds_the_knee_and_a_cap_that_holds_goodput(tmp_path) -> None:
    base = offered_rate(load_arrivals("mooncake-conversation", limit=200))
    rates = ",".join(f"{s * base:.4f}" for s in (0.1, 0.2, 0.6, 1.0))
    r = kvdeck("sweep", "mooncake-conversation", "--rates", rates, "--json",
               "--svg", str(tmp_path / "sweep.svg"))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    points, knee = result["points"], result["knee"]
    peak = max(p["goodput_rps"] for p in points)
    assert result["knee_inside"]
    assert knee["goodput_rps"] == peak and points[0]["rate_rps"] < knee["rate_rps"]
    past = [p for p in points if p["rate_rps"] > knee["rate_rps"]]
    assert past and all(p["goodput_rps"] < 0.5 * peak for p in past)  # it collapses
    assert all(p["completion_rps"] >= 0.9 * knee["completion_rps"] for p in past)
    cap = result["recommended_max_waiting"]
    assert cap == -(-knee["mean_resident"] // 1)
    capped = result["capped"]
    assert [p["rate_rps"] for p in capped] == [p["rate_rps"] for p in past]
    assert all(p["cap"] == cap and p["goodput_rps"] >= 0.9 * peak and p["num_rejected"] > 13
               for p in capped)
    assert result["cap_holds_goodput"] is True
    assert ET.parse(tmp_path / "sweep.svg").getroot().tag.endswith("svg")


def test_bad_rates_get_one_sentence() -> None:
    for rates, message in [("fast", "--rates must be comma-separated numbers"),
                           ("1", "--rates needs at least two different rates"),
                           ("1,-2", "--rates needs at least two different rates, each above 0"),
                           ("1,1", "--rates needs at least two different rates")]:
        r = kvdeck("sweep", "--rates", rates)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_the_batch_sweep_trades_first_token_time_for_throughput() -> None:
    r = kvdeck("sweep", "--batch", "1,16", "--prompt-len", "2048", "--output-len", "32",
               "--kv-memory-gib", "16", "--chunk-size", "2048",
               "--max-num-batched-tokens", "8192", "--json")
    assert r.returncode == 0, r.stderr
    one, sixteen = json.loads(r.stdout)["points"]
    assert (one["batch"], sixteen["batch"]) == (1, 16)
    assert sixteen["throughput_tps"] > 4 * one["throughput_tps"]
    assert sixteen["ttft_mean_s"] > 4 * one["ttft_mean_s"]
    # The sim's reference card: a full batch-16 decode step reads D_w + 16·L·k, 41 % MBU.
    assert 0.38 < sixteen["mbu"] < 0.44 and 0.31 < one["mbu"] < 0.35
    bad = kvdeck("sweep", "--batch", "4")
    assert bad.returncode == 2 and "--batch needs at least two different batch sizes" in \
        bad.stderr


def test_continuous_admission_keeps_goodput_one_at_a_time_loses() -> None:
    r = kvdeck("sweep", "--admission", "one-at-a-time,continuous,all-at-once", "--rates",
               "1,8", "--num-requests", "30", "--prompt-len", "512", "--output-len", "64",
               "--json")
    assert r.returncode == 0, r.stderr
    modes = json.loads(r.stdout)
    at8 = {m: points[-1]["goodput_rps"] for m, points in modes.items()}
    assert at8["continuous"] > at8["all-at-once"] > at8["one-at-a-time"]
    bad = kvdeck("sweep", "--admission", "greedy")
    assert bad.returncode == 2 and "--admission takes one-at-a-time, continuous" in bad.stderr
