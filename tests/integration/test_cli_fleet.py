"""The simulated fleet from the command line, as a user runs it: `kvdeck run-trace
--replicas/--router`, disaggregated serving, `kvdeck sweep --replicas --router`, and bad
input in one sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET


def kvdeck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})


def test_run_trace_on_a_fleet_reports_the_fleet_and_each_replica() -> None:
    r = kvdeck("run-trace", "mooncake-conversation", "--limit", "40", "--replicas", "3",
               "--router", "weighted:prefix=3,kv=1,queue=2", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    s = data["summary"]
    assert s["num_replicas"] == 3 and s["router"] == "weighted:prefix=3,kv=1,queue=2"
    assert s["num_requests"] == 40 and len(data["requests"]) == 40
    assert [row["name"] for row in data["replicas"]] == ["r0", "r1", "r2"]
    assert sum(row["requests"] for row in data["replicas"]) == 40
    text = kvdeck("run-trace", "mooncake-conversation", "--limit", "40", "--replicas", "3",
                  "--router", "prefix").stdout
    assert "load imbalance" in text and "replicas" in text and "prefix hit rate" in text


def test_disaggregated_run_shows_the_kv_it_moved() -> None:
    r = kvdeck("run-trace", "azure-conv", "--limit", "30", "--prefill-replicas", "1",
               "--decode-replicas", "2", "--kv-link-bandwidth", "25", "--kv-transfer", "after")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "replicas (prefill + decode) │ 3 (1 + 2)" in out
    assert "KV moved between instances GB" in out and "decode capacity idle" in out


def test_sweep_over_fleets_gives_a_knee_per_fleet(tmp_path) -> None:
    svg = tmp_path / "fleets.svg"
    r = kvdeck("sweep", "azure-code", "--limit", "40", "--rates", "0.5,2,8", "--replicas",
               "1,2", "--router", "least-loaded", "--router", "random", "--svg", str(svg),
               "--json")
    assert r.returncode == 0, r.stderr
    configs = json.loads(r.stdout)["configs"]
    assert [c["config"] for c in configs] == ["1 × least-loaded", "1 × random",
                                              "2 × least-loaded", "2 × random"]
    assert all(len(c["points"]) == 3 and c["knee"] for c in configs)
    root = ET.parse(svg).getroot()
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 4


def test_bad_fleet_input_is_one_sentence() -> None:
    cases = [
        (("run-trace", "azure-conv", "--replicas", "2", "--router", "nearest"),
         "Unknown router 'nearest'"),
        (("run-trace", "azure-conv", "--replicas", "3", "--prefill-replicas", "1",
          "--decode-replicas", "1"), "--replicas 3 does not add up"),
        (("run-trace", "azure-conv", "--replicas", "2", "--executor", "torch"),
         "A fleet runs on the sim executor"),
        (("run-trace", "azure-conv", "--prefill-replicas", "1", "--decode-replicas", "1",
          "--kv-transfer", "sometimes"), "kv_transfer must be one of layerwise, after"),
        (("run-trace", "azure-conv", "--replicas", "2", "--model-profile", "llama-70b",
          "--hardware", "h100-sxm", "--memory-utilization", "0.9"),
         "TP1 on h100-sxm cannot hold llama-70b"),
        (("sweep", "azure-conv", "--replicas", "0"), "--replicas must be"),
        (("run-trace", "azure-conv", "--prefill-replicas", "1", "--decode-replicas", "1",
          "--kv-link-bandwidth", "0"), "The KV link's bandwidth must be above 0"),
    ]
    for args, message in cases:
        r = kvdeck(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert message in " ".join(r.stderr.split()), (args, r.stderr)
        assert "Traceback" not in r.stderr
