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
