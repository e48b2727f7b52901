"""`kvdeck bench` times a request from its scheduled arrival, as the engine does: under a
concurrency limit, the wait for a free place counts in TTFT and E2E (queueing outside the
server), and the send is kept beside it (`admitted`, `queue_time`, `ttft_from_send_s`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvdeck.runtime.runs.loadgen import run_bench
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
