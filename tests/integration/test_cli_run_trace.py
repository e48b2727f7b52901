"""`kvdeck run-trace` and `kvdeck compare` as a user runs them, on the public traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdeck.runtime.runs.recording import read_run
from tests.paths import AZURE_CONV, MOONCAKE


def kvdeck(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_mooncake_with_16_gib_reports_prefix_hits(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("kv_memory_bytes = 17179869184  # 16 GiB\n"
                   "max_num_batched_tokens = 8192\nchunk_size = 2048\n")
    r = kvdeck("run-trace", str(MOONCAKE), "--config", str(cfg), "--limit", "300", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    s = result["summary"]
    assert s["num_requests"] == 300 == len(result["requests"])
    # 16 GiB at 144 KiB per token: 116,508 tokens, 7,281 blocks of 16.
    assert s["num_blocks"] == 7_281
    assert s["prefix_hit_rate"] > 0.1 and s["cached_prompt_tokens"] > 0
    assert sum(s["statuses"].values()) == 300  # every request accounted for
    rejected = [q for q in result["requests"] if q["status"] == "rejected"]
    for q in rejected:  # prompts over Qwen3-8B's 40,960-token context
        assert q["reason"].startswith("The prompt has") and q["prompt_tokens"] > 40_959
    ll = s["littles_law"]
    assert ll["measured_mean_resident"] == pytest.approx(ll["predicted_mean_resident"])


def test_azure_conv_runs_and_records(tmp_path: Path) -> None:
    out_a = tmp_path / "a.json"
    r = kvdeck("run-trace", str(AZURE_CONV), "--limit", "120", "--time-scale", "4",
               "--record", str(tmp_path / "run"), "-o", str(out_a))
    assert r.returncode == 0, r.stderr
    assert "completion throughput" in r.stdout and "TTFT p99" in r.stdout
    header, records = read_run(tmp_path / "run")
    assert header["num_blocks"] > 0 and records
    assert len((tmp_path / "run" / "arrivals.jsonl").read_text().splitlines()) == 120
    per_req = json.loads(out_a.read_text())["requests"]
    first = per_req[0]
    for key in ("arrival", "admitted", "first_token", "finish", "itls", "status"):
        assert key in first
    # Re-run the recorded arrivals under another configuration, then compare.
    cfg = tmp_path / "b.toml"
    cfg.write_text('kv_memory_bytes = 8589934592\nqueue_policy = "sjf"\n')
    out_b = tmp_path / "b.json"
    r = kvdeck("run-trace", str(tmp_path / "run" / "arrivals.jsonl"), "--config", str(cfg),
               "-o", str(out_b))
    assert r.returncode == 0, r.stderr
    b = json.loads(out_b.read_text())["requests"]
    assert [q["prompt_tokens"] for q in b] == [q["prompt_tokens"] for q in per_req]
    r = kvdeck("compare", str(out_a), str(out_b))
    assert r.returncode == 0, r.stderr
    assert "Δ = B − A" in r.stdout and "goodput" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["run-trace", "/nonexistent.jsonl"],
     "Trace file /nonexistent.jsonl does not exist; sample traces are azure-conv, azure-code, "
     "mooncake-conversation, llm-d-shared-prefix."),
    (["run-trace", str(AZURE_CONV), "--executor", "vllm"],
     "executor must be one of sim, torch, llama_cpp, got 'vllm'."),
    (["compare", "/nope-a.json", "/nope-b.json"], "Result file /nope-a.json does not exist."),
])
def test_bad_arguments(args: list[str], message: str) -> None:
    r = kvdeck(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_bad_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("block_size = 0\n")
    r = kvdeck("run-trace", str(AZURE_CONV), "--config", str(cfg), "--limit", "3")
    assert r.returncode == 2 and "block_size must be an integer from 1 to 256, got 0." in r.stderr
    cfg.write_text("warp_drive = 9\n")
    r = kvdeck("run-trace", str(AZURE_CONV), "--config", str(cfg), "--limit", "3")
    assert r.returncode == 2 and "Unknown setting 'warp_drive'; allowed settings are" in r.stderr
    cfg.write_text("block_size = [\n")
    r = kvdeck("run-trace", str(AZURE_CONV), "--config", str(cfg), "--limit", "3")
    assert r.returncode == 2 and "is not valid TOML" in r.stderr


def test_log_level_on_every_command() -> None:
    r = kvdeck("models", "--log-level", "loud")
    assert r.returncode == 2
    assert "--log-level must be one of debug, info, warning, error, got 'loud'." in r.stderr
    r = kvdeck("run-trace", "azure-conv", "--limit", "2", "--log-level", "debug")
    assert r.returncode == 0, r.stderr
    assert "DEBUG kvdeck.engine: inbox" in r.stderr  # each request entering the inbox
    for command in ("console", "serve", "run-trace", "bench", "calibrate", "models", "attach",
                    "replay", "compare"):
        assert "--log-level" in kvdeck(command, "--help").stdout, command


def test_replay_summary_equals_run_trace_on_the_same_run(tmp_path: Path) -> None:
    """Live (run-trace) and replayed figures come from the same code and agree exactly."""
    slo = ["--slo-ttft", "0.5", "--slo-tpot", "0.05"]
    r = kvdeck("run-trace", "azure-code", "--limit", "150", "--time-scale", "0.25",
               "--kv-memory-gib", "2", "--record", str(tmp_path / "run"), "--json", *slo)
    assert r.returncode == 0, r.stderr
    live = json.loads(r.stdout)["summary"]
    assert live["statuses"] == {"finished_length": 150}  # all entered the engine
    assert live["num_preemptions"] > 10 and live["prefix_hit_rate"] > 0  # under pressure
    assert 0 < live["num_good"] < 150  # the SLOs split the requests
    r = kvdeck("replay", str(tmp_path / "run"), "--summary", "--json", *slo)
    assert r.returncode == 0, r.stderr
    replayed = json.loads(r.stdout)
    assert replayed["unfinished"] == 0 and not replayed["truncated"]
    for key, value in live.items():
        assert replayed[key] == value, key
    r = kvdeck("replay", str(tmp_path / "run"), "--summary")
    assert r.returncode == 0 and "goodput" in r.stdout and "TTFT p99" in r.stdout


def test_requests_served_before_a_trace_leave_their_cache_and_are_not_counted(
        tmp_path: Path) -> None:
    """`--before`: a request served first leaves its prefix cached for the trace, and is in
    none of the trace's figures; `--warmup` (bench's, sharing nothing) runs and changes
    nothing here."""
    prefix = list(range(100, 612))
    trace, first = tmp_path / "trace.jsonl", tmp_path / "before.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": t, "output_len": 8,
                                         "prompt_tokens": prefix + list(range(n, n + 64))})
                             + "\n" for t, n in ((0.0, 1000), (5.0, 2000))))
    first.write_text(json.dumps({"arrival_s": 3.0, "output_len": 4,
                                 "prompt_tokens": prefix + list(range(3000, 3064))}) + "\n")

    def run(*args: str) -> dict:
        r = kvdeck("run-trace", str(trace), "--json", *args)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    plain, before = run(), run("--before", str(first))
    warm = run("--warmup", "--record", str(tmp_path / "warm"))
    for result in (plain, before, warm):
        assert result["summary"]["num_requests"] == 2
        assert [q["arrival"] for q in result["requests"]] == pytest.approx([0.0, 5.0])
    assert [q["cached_tokens"] for q in plain["requests"]][0] == 0
    assert before["requests"][0]["cached_tokens"] == 512
    assert before["requests"][0]["ttft"] < plain["requests"][0]["ttft"]
    # The engine's figures start after the request before: its prompt is not counted.
    assert before["summary"]["steps"]["prefill_tokens"] == \
        plain["summary"]["steps"]["prefill_tokens"] - 512
    for key in ("ttft", "tpot", "e2e", "cached_tokens"):
        assert [q[key] for q in warm["requests"]] == \
            pytest.approx([q[key] for q in plain["requests"]]), key
    # The warm-up ran (the recording keeps every request the engine served).
    r = kvdeck("replay", str(tmp_path / "warm"), "--summary", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["num_requests"] == 3, r.stderr
    r = kvdeck("run-trace", str(trace), "--warmup", "--replicas", "2")
    assert r.returncode == 2 and "--before and --warmup run on one engine" in r.stderr


def test_requests_before_a_trace_draw_prompts_of_their_own_and_are_checked(
        tmp_path: Path) -> None:
    """Requests without tokens, before and in the trace, get prompts of their own (the
    trace's first request shares nothing with the one before it); a request refused in the
    trace keeps its trace time; one refused before it stops the run with a sentence."""
    trace, first = tmp_path / "trace.jsonl", tmp_path / "before.jsonl"
    trace.write_text('{"arrival_s": 0.0, "output_len": 4, "prompt_len": 600}\n'
                     '{"arrival_s": 2.0, "output_len": 4, "prompt_len": 50000}\n')
    first.write_text('{"arrival_s": 0.0, "output_len": 4, "prompt_len": 600}\n')
    r = kvdeck("run-trace", str(trace), "--before", str(first), "--json")
    assert r.returncode == 0, r.stderr
    served, refused = json.loads(r.stdout)["requests"]
    assert served["cached_tokens"] == 0
    assert refused["status"] == "rejected" and refused["arrival"] == 2.0
    first.write_text('{"arrival_s": 0.0, "output_len": 4, "prompt_len": 50000}\n')
    r = kvdeck("run-trace", str(trace), "--before", str(first))
    assert r.returncode == 2 and "--before's request 1 was refused: The prompt has" \
        in r.stderr and "Traceback" not in r.stderr
