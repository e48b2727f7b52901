"""`kvdeck serve --executor sim`: the OpenAI API with a simulated datacenter card's timing,
started as a user starts it, driven by the official `openai` client, `kvdeck bench` and the
attach parser."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from kvdeck.runtime.runs.attach import parse_metrics
from tests.servers import sim_process

MODEL = "qwen3-8b"


@contextmanager
def sim_server(*args: str) -> Iterator[str]:
    """The base URL of `kvdeck serve --executor sim --port 0 ARGS`."""
    with sim_process(*args) as server:
        yield server.url


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with sim_server() as url:
        yield url


def idle(url: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while True:
        status = parse_metrics(httpx.get(url.removesuffix("/v1") + "/metrics").text)
        if status.running == 0 and status.waiting == 0:
            return
        assert time.monotonic() < end
        time.sleep(0.05)


def test_openai_client_gets_exactly_max_tokens_at_the_simulated_pace(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="Explain paged attention", max_tokens=20)
    # The stand-in tokenizer: one readable word per token, counted exactly.
    assert r.usage.completion_tokens == 20 and len(r.choices[0].text.split()) == 20
    assert r.usage.prompt_tokens == 3 and r.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=7)
    assert chat.usage.completion_tokens == 7
    assert len(chat.choices[0].message.content.split()) == 7

    def itl_sum() -> float:
        text = httpx.get(server.removesuffix("/v1") + "/metrics").text
        return float(re.search(r"^vllm:inter_token_latency_seconds_sum\S* (\S+)$", text,
                               re.M).group(1))

    idle(server)
    before = itl_sum()
    times = []
    stream = client.completions.create(model=MODEL, prompt="Count to fifty", max_tokens=50,
                                       stream=True, stream_options={"include_usage": True})
    words = 0
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            words += len(chunk.choices[0].text.split())
        if chunk.usage:
            usage = chunk.usage
    assert words == 50 and usage.completion_tokens == 50
    idle(server)
    modelled = itl_sum() - before  # the 49 inter-token gaps on the simulated card
    measured = times[-1] - times[0]
    assert modelled > 49 * 0.026  # Qwen3-8B decode on the RTX PRO 6000: ~26 ms per step
    assert abs(measured - modelled) / modelled < 0.10, (measured, modelled)


def test_metrics_health_and_attach_work_unchanged(server: str) -> None:
    base = server.removesuffix("/v1")
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    status = parse_metrics(httpx.get(base + "/metrics").text)
    assert status.engine == "kvdeck" and status.kv_usage is not None and status.kv_blocks
    assert not {"running requests", "KV cache usage", "TTFT histogram"} & set(status.missing())
    config = httpx.get(base + "/kvdeck/config").json()
    assert config["settings"]["executor"] == "sim" and config["num_blocks"] == 7_281


def trace_file(tmp_path: Path) -> Path:
    """30 requests over 6 s, half sharing a 3,840-token system prompt, 24 output tokens:
    first tokens of about 400 ms on the simulated card, so the 10 to 15 ms that HTTP, the
    JSON of the prompt and the threads of two processes on a small CI machine add to each
    (measured: a 116 ms first token came back 8 to 14 ms late) stay a few per cent."""
    p = tmp_path / "trace.jsonl"
    lines = []
    for i in range(30):
        rec = {"arrival_s": 0.2 * i, "prompt_len": 3750 + 342 * (i % 7), "output_len": 24,
               "id": f"t{i}"}
        if i % 2 == 0:
            rec.update(prompt_len=6000, prefix_group="sys", prefix_len=3840)
        lines.append(json.dumps(rec))
    p.write_text("\n".join(lines) + "\n")
    return p


def kvdeck(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args, "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_bench_against_the_sim_server_reproduces_run_trace(tmp_path: Path) -> None:
    trace = trace_file(tmp_path)
    cfg = tmp_path / "run.toml"
    cfg.write_text("max_num_batched_tokens = 4096\nchunk_size = 1024\n")
    offline = kvdeck("run-trace", str(trace), "--config", str(cfg))["summary"]
    with sim_server("--config", str(cfg)) as url:
        online = kvdeck("bench", str(trace), "--url", url, "--model", MODEL)["summary"]
    assert online["statuses"] == offline["statuses"] == {"finished_length": 30}
    for key in ("ttft_s", "tpot_s"):
        a, b = offline[key]["p50"], online[key]["p50"]
        assert abs(b - a) / a < 0.10, (key, a, b)


def test_bench_caps_requests_in_flight_and_sends_text_prompts() -> None:
    """`--concurrency 2`: never more than two requests between send and last byte, though
    all six arrive at once; `--text-prompts`: passage windows the server tokenizes to about
    the asked length; `--exact-length-field min_tokens` is sent (as llama-cpp-python's server
    takes it) and kvdeck honours it too."""
    common = ("--model", "gemma3-270m", "--text-prompts", "--prompt-len", "64",
              "--output-len", "8", "--length-spread", "0", "--num-requests", "6", "--rate",
              "1000", "--no-warmup")
    with sim_server("--tokenizer", "gemma3-270m", "--served-model-name", "gemma3-270m",
                    "--pace", "1") as url:
        got = kvdeck("bench", "--url", url, "--concurrency", "2", *common)
        base = url.removesuffix("/v1")
        prompt_tokens = parse_metrics(httpx.get(base + "/metrics").text).prompt_tokens
        exact = kvdeck("bench", "--url", url, "--exact-length-field", "min_tokens", *common)
    assert got["summary"]["statuses"] == {"finished_length": 6}
    # In flight from the send (`admitted`) to the last byte; each clock starts at the
    # scheduled arrival, so the wait for a place is in the later ones' queue time.
    spans = [(r["admitted"], r["finish"]) for r in got["requests"]]
    for t, _ in spans:
        assert sum(1 for a, b in spans if a <= t < b) <= 2
    assert max(a for a, _ in spans) > min(b for _, b in spans)  # later ones waited
    assert max(r["queue_time"] for r in got["requests"]) > 0
    assert 6 * 60 <= prompt_tokens <= 6 * 68
    assert exact["summary"]["statuses"] == {"finished_length": 6}
    assert all(r["output_tokens"] == 8 for r in exact["requests"])


def test_serve_and_run_trace_build_identical_engines_from_one_config(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('executor = "sim"\nkv_memory_bytes = 8589934592\nblock_size = 32\n'
                   'max_num_seqs = 64\nqueue_policy = "sjf"\nchunk_size = 512\n'
                   'hardware = "rtx-pro-6000"\nseed = 4\n')
    offline = kvdeck("run-trace", "azure-conv", "--limit", "3", "--config", str(cfg))
    with sim_server("--config", str(cfg)) as url:
        online = httpx.get(url.removesuffix("/v1") + "/kvdeck/config").json()
    assert online["engine"] == offline["config"]["engine"]
    assert online["num_blocks"] == offline["config"]["num_blocks"] == 8192 * 1024 // (32 * 144)
    settings = online["settings"]
    assert settings == offline["config"]["settings"]
    assert (settings["block_size"], settings["max_num_seqs"], settings["queue_policy"]) == \
        (32, 64, "sjf")


VLLM_FLAGS = {  # flag, value on the command line, settings key, value it must reach
    "--max-num-seqs": ("48", "max_num_seqs", 48),
    "--max-num-batched-tokens": ("3000", "max_num_batched_tokens", 3000),
    "--no-enable-prefix-caching": (None, "enable_prefix_caching", False),
    "--block-size": ("32", "block_size", 32),
    "--kv-cache-dtype": ("fp16", "kv_format", "fp16"),
    "--max-model-len": ("20000", "max_model_len", 20000),
    "--seed": ("11", "seed", 11),
    "--kv-memory-gib": ("2", "kv_memory_bytes", 2 << 30),
    "--chunk-size": ("700", "chunk_size", 700),
    "--queue-policy": ("edf", "queue_policy", "edf"),
}


def test_every_vllm_named_flag_reaches_the_engine_in_serve_and_run_trace() -> None:
    args = [a for flag, (value, _, _) in VLLM_FLAGS.items()
            for a in ((flag,) if value is None else (flag, value))]
    offline = kvdeck("run-trace", "azure-conv", "--limit", "2", *args)["config"]
    with sim_server(*args) as url:
        online = httpx.get(url.removesuffix("/v1") + "/kvdeck/config").json()
    for config in (offline, online):
        engine = config["engine"]
        flat = {**engine, **engine["knobs"]}
        for flag, (_, key, value) in VLLM_FLAGS.items():
            assert config["settings"][key] == value, flag
            assert flat[key] == value, flag
        # 2 GiB of fp16 KV (Qwen3-8B: 147,456 B per token) in blocks of 32 tokens.
        assert config["num_blocks"] == (2 << 30) // (32 * 147_456) == 455
        assert config["max_model_len"] == 20000


def test_an_engine_failure_reaches_every_client_and_sigint_exits_cleanly(tmp_path) -> None:
    with sim_process("--fail-at-step", "12", env={"KVDECK_CACHE": str(tmp_path)}) as server:
        base = server.url.removesuffix("/v1")
        body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 100,
                "stream": True}
        with httpx.stream("POST", server.url + "/completions", json=body, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        last = json.loads(events[-1][6:])
        assert last["error"]["code"] == 503
        assert last["error"]["message"] == (
            "The request was aborted: engine failed: RuntimeError: injected failure at "
            "step 12 (fail_at_step).")
        assert 5 < len(events) < 100  # tokens streamed until the failure, then the error
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        (log,) = (tmp_path / "logs").glob("failure-*.log")
        assert str(log) in health.json()["reason"] and "Traceback" in log.read_text()
        r = httpx.post(server.url + "/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 503 and "The engine has stopped" in r.json()["error"]["message"]
        assert "kvdeck:engine_failed" in httpx.get(base + "/metrics").text
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(20) == 0
        assert "Traceback" not in server.proc.stderr.read()


def running(base: str) -> float:
    return parse_metrics(httpx.get(base + "/metrics").text).running or 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_drains_for_the_shutdown_timeout_then_aborts_and_exits_0(signum) -> None:
    with sim_process("--shutdown-timeout", "1") as server:
        base = server.url.removesuffix("/v1")
        answers: list[httpx.Response] = []
        orphan = threading.Thread(target=lambda: answers.append(httpx.post(
            server.url + "/completions", timeout=60,
            json={"model": MODEL, "prompt": "never ends", "max_tokens": 5000})))
        orphan.start()
        end = time.monotonic() + 20
        while running(base) < 1:
            assert time.monotonic() < end
            time.sleep(0.05)
        start = time.monotonic()
        server.proc.send_signal(signum)
        assert server.proc.wait(20) == 0
        assert time.monotonic() - start < 5  # 1 s of drain, then the abort and the exit
        orphan.join(20)
        stderr = server.proc.stderr.read()
    assert "Traceback" not in stderr, stderr
    assert answers[0].status_code == 503
    assert "the server shut down and its 1-s drain ended" in answers[0].json()["error"]["message"]


def test_a_second_sigint_exits_at_once() -> None:
    with sim_process("--shutdown-timeout", "60") as server:
        base = server.url.removesuffix("/v1")
        body = {"model": MODEL, "prompt": "stream forever", "max_tokens": 5000, "stream": True}
        events: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", server.url + "/completions", json=body,
                              timeout=60) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        streamer = threading.Thread(target=stream)
        streamer.start()
        while running(base) < 1:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(10) == 0
        assert time.monotonic() - start < 3
        streamer.join(10)
        assert "Traceback" not in server.proc.stderr.read()
    # The client was told: its stream ended with an error event, not a cut connection.
    assert json.loads(events[-1][6:])["error"]["message"] == \
        "The request was aborted: the server was stopped."
