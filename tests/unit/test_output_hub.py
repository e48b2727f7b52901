"""The server's output channels: a request that finished before its handler started
watching it still gets its whole output (the engine may refuse or finish it first, then stay
idle: nothing else would publish it)."""

from __future__ import annotations

import asyncio

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.server.streams import OutputHub


def test_watching_a_finished_request_delivers_its_output() -> None:
    e = Engine(EngineConfig(block_size=16, num_blocks=64, knobs=Knobs()),
               SimExecutor(SimConfig(eos_probability=0.0)))
    hub = OutputHub(e)
    req = e.add_request(list(range(3, 40)), SamplingParams(max_tokens=5))
    too_big = e.add_request([3] * 2000, SamplingParams(max_tokens=5))
    e.run_until_idle()
    assert req.status.is_finished and too_big.status.is_finished

    async def watch_after_the_fact():
        out = []
        for r in (req, too_big):
            delta = await asyncio.wait_for(hub.watch(r).get(), 5)
            out.append(delta)
        return out

    done, rejected = asyncio.run(watch_after_the_fact())
    assert done.finished and rejected.finished
    assert hub.watched_ids() == []  # forgotten once their last delta was posted
