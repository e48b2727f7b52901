"""Parsing each engine's /metrics text (stored samples written from documented names)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.attach import Histogram, parse_metrics
from runtime.errors import KvdeckError

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"


def test_vllm() -> None:
    st = parse_metrics((DATA / "vllm.txt").read_text())
    assert st.engine == "vllm" and (st.running, st.waiting) == (12, 3)
    assert st.kv_usage == 0.42 and st.hit_rate == 0.25 and st.preemptions == 7
    assert st.spec_acceptance == 2.5
    # 100 samples: 10 ≤ 0.1 s, 80 in (0.1, 0.5], 10 in (0.5, 1]: p50 = 0.1 + 0.4·40/80.
    assert st.ttft.quantile(0.5) == pytest.approx(0.3) and st.ttft.mean == 0.3
    assert "KV block states" in st.missing() and "TTFT histogram" not in st.missing()


def test_sglang() -> None:
    st = parse_metrics((DATA / "sglang.txt").read_text())
    assert st.engine == "sglang" and (st.running, st.waiting) == (28, 5)
    assert st.kv_usage == 0.28 and st.hit_rate == 0.0075
    assert st.ttft.quantile(0.99) == pytest.approx(0.99)
    assert "preemptions" in st.missing() and "speculative acceptance" in st.missing()


def test_llamacpp() -> None:
    st = parse_metrics((DATA / "llamacpp.txt").read_text())
    assert st.engine == "llama.cpp" and (st.running, st.waiting) == (2, 1)
    assert st.kv_usage == 0.1 and st.generated_tokens_per_s == 65
    assert {"TTFT histogram", "prefix-cache hit rate"} <= set(st.missing())


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

    from runtime.attach import parse_slots

    assert parse_slots(json.loads((DATA / "llamacpp_slots.json").read_text())) == (2, 3)
    with pytest.raises(KvdeckError, match="did not return a list of slots"):
        parse_slots({"error": "slots disabled"})
