"""`kvdeck bench` times a request from its scheduled arrival, as the engine does: under a
concurrency limit, the wait for a free place counts in TTFT and E2E (queueing outside the
server), and the send is kept beside it (`admitted`, `queue_time`, `ttft_from_send_s`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from kvdeck.runtime.runs.loadgen import EARLY_S, RequestShape, _until, run_bench, warmup_body
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.server.serve import ApiServer
from tests.servers import sim_in_process


@pytest.fixture(scope="module")
def sim() -> Iterator[ApiServer]:
    with sim_in_process() as srv:
        yield srv


def test_waiting_for_a_place_counts_from_the_scheduled_arrival(sim: ApiServer) -> None:
    arrivals = [Arrival(0.0, 32, 8, request_id=f"r{i}") for i in range(3)]
    result = asyncio.run(run_bench(f"http://127.0.0.1:{sim.port}/v1", "sim", arrivals,
                                   concurrency=1, warmup=False))
    reqs = sorted(result["requests"], key=lambda m: m["admitted"])
    assert [m["status"] for m in reqs] == ["finished_length"] * 3
    for m in reqs:
        assert m["arrival"] == 0.0  # every clock starts at the scheduled arrival
        assert m["queue_time"] == pytest.approx(m["admitted"] - m["arrival"])
        assert m["ttft"] == pytest.approx(m["first_token"] - m["arrival"])
        assert m["e2e"] == pytest.approx(m["finish"] - m["arrival"])
    # One place: each request is sent after the one before it finished, and its wait is in
    # its TTFT.
    for before, after in zip(reqs, reqs[1:], strict=False):
        assert after["admitted"] >= before["finish"]
        assert after["queue_time"] > 0 and after["ttft"] > after["queue_time"]
    s = result["summary"]
    assert s["ttft_from_send_s"]["p50"] < s["ttft_s"]["p50"]
    assert s["queue_s"]["p50"] > 0


def test_a_burst_after_an_idle_spell_goes_out_in_its_order_and_never_early(
        sim: ApiServer) -> None:
    """A long sleep ends early (`loadgen._until`): Linux fires a long timeout late by a
    thousandth of it, which sent a burst due milliseconds apart at once. No request goes
    before its time."""
    arrivals = [Arrival(0.0, 16, 2, request_id="first")]
    arrivals += [Arrival(1.5 + 0.02 * i, 16, 2, request_id=f"b{i}") for i in range(4)]
    result = asyncio.run(run_bench(f"http://127.0.0.1:{sim.port}/v1", "sim", arrivals,
                                   warmup=False))
    reqs = result["requests"]
    assert [m["status"] for m in reqs] == ["finished_length"] * 5
    assert all(m["admitted"] >= m["arrival"] for m in reqs)
    sent = sorted(reqs, key=lambda m: m["admitted"])
    assert [m["request_id"] for m in sent] == ["first", "b0", "b1", "b2", "b3"]


def test_until_never_returns_before_its_time() -> None:
    for ahead in (0.0, 0.01, EARLY_S + 0.05):
        t = time.perf_counter() + ahead
        asyncio.run(_until(t))
        assert time.perf_counter() >= t


def test_the_warm_up_is_as_long_as_the_first_prompt_and_shares_no_prefix_with_it() -> None:
    arrivals = [Arrival(0.0, 576, 8, prompt_tokens=tuple(range(100, 676))),
                Arrival(1.0, 64, 8)]
    body = warmup_body("m", RequestShape(), arrivals)
    assert len(body["prompt"]) == 576 and body["max_tokens"] == 2
    assert body["prompt"][0] != arrivals[0].prompt_tokens[0]
    assert len(warmup_body("m", RequestShape(), [])["prompt"]) == 16
