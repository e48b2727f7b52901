"""`kvdeck serve --kv-events-config`: kvdeck's prefix-cache changes published as vLLM's KV
events, read back by kvdeck's subscriber over real ZeroMQ sockets, block for block equal to
the engine's own prefix tree — live, and for a subscriber that attaches late and asks the
replay endpoint for what it missed."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.fleet.publisher import EventPublisher, KVEventsConfig
from kvdeck.runtime.fleet.subscriber import Subscriber, plan_socket
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from tests.servers import idle, in_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_chains(tree) -> set[tuple[int, ...]]:
    """Every device-resident cached block as the tokens from the root through it."""
    out = set()
    for node in tree.nodes.values():
        if node.on_host:
            continue
        tokens, n = (), node
        while n is not None and n.key:
            tokens, n = n.key + tokens, n.parent
        out.add(tokens)
    return out


def subscriber_chains(cache, medium: str = "GPU", only: bool = False) -> set[tuple[int, ...]]:
    """Every block on `medium` (`only`: on it alone) as the tokens from the root through it."""
    out = set()
    for b in cache.blocks.values():
        if medium not in b.media or (only and b.media != {medium}):
            continue
        tokens, cur = (), b
        while cur is not None:
            tokens = cur.tokens + tokens
            cur = cache.blocks.get(cur.parent) if cur.parent is not None else None
        out.add(tokens)
    return out


def wait_for(sub: Subscriber, count: int, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while sub.snapshot()[1].messages < count:
        assert time.monotonic() < end, f"{sub.snapshot()[1]} after {timeout} s"
        time.sleep(0.05)


def test_published_events_rebuild_the_engines_tree_block_for_block() -> None:
    pub_port, replay_port = free_port(), free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                            replay_endpoint=f"tcp://*:{replay_port}", topic="kv")
    # A pool of about 60 blocks: the distinct prompts below evict the early ones.
    session = build_session(resolve({"executor": "sim", "served_model_name": "sim",
                                     "kv_memory_bytes": 150_000_000}), live=True)
    engine = session.engine
    publisher = EventPublisher(config, engine.kv.block_size).start().attach(engine)
    live = Subscriber(config.endpoint, replay=config.replay_endpoint, topic="kv").start()
    rng = random.Random(3)
    prefix = [rng.randrange(100, 30_000) for _ in range(64)]
    prompts = [prefix + [rng.randrange(100, 30_000) for _ in range(40)] for _ in range(4)]
    prompts += [[rng.randrange(100, 30_000) for _ in range(200)] for _ in range(8)]
    try:
        with in_process(session) as srv:
            time.sleep(0.3)  # the SUB socket's connection is asynchronous
            for p in prompts:
                r = httpx.post(f"http://127.0.0.1:{srv.port}/v1/completions", timeout=60,
                               json={"model": "sim", "prompt": p, "max_tokens": 4})
                assert r.status_code == 200, r.text
            idle(srv)
            wait_for(live, publisher.seq)
            assert engine.kv.tree.num_evictions > 0
            want = engine_chains(engine.kv.tree)
            cache, status = live.snapshot()
            assert status.gaps == () and status.bad == 0 and status.unknown == {}
            assert subscriber_chains(cache) == want and len(want) > 10
            # A subscriber that attaches now gets the history from the replay endpoint.
            late = Subscriber(config.endpoint, replay=config.replay_endpoint,
                              topic="kv").start()
            wait_for(late, publisher.seq)
            late_cache, late_status = late.snapshot()
            assert late_status.refilled == publisher.seq
            assert subscriber_chains(late_cache) == want
            late.stop()
    finally:
        live.stop()
        publisher.close()


def test_socket_plans_follow_vllms_bind_rule() -> None:
    assert plan_socket("tcp://*:5557") == ("connect", "tcp://127.0.0.1:5557")
    assert plan_socket("tcp://*:5557", "10.0.0.2") == ("connect", "tcp://10.0.0.2:5557")
    assert plan_socket("tcp://127.0.0.1:5557") == ("bind", "tcp://127.0.0.1:5557")
    assert plan_socket("ipc:///tmp/kv") == ("connect", "ipc:///tmp/kv")


@pytest.mark.parametrize("text, said", [
    ("not json", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "endpont": "x"}', "no field 'endpont'"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be a positive"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be"),
])
def test_bad_configs_get_one_sentence(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        KVEventsConfig.parse(text)


def test_serve_refuses_a_bad_config_in_one_sentence() -> None:
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "serve", "--executor",
                        "sim", "--port", "0", "--kv-events-config", '{"hwm": -1}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "hwm must be a positive integer" in r.stderr and "Traceback" not in r.stderr


def test_a_host_tier_publishes_cpu_blocks() -> None:
    """Demoted blocks are `BlockStored` with medium CPU (after `BlockRemoved` GPU), promoted
    ones the reverse: the subscriber's media equal the engine's tiers, block for block."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
    from kvdeck.runtime.runs.runner import run_arrivals
    from kvdeck.runtime.runs.trace import Arrival

    ex = SimExecutor(SimConfig(), seed=3)
    per_block = 16 * ex.kv_bytes_per_token("bf16")
    engine = Engine(EngineConfig(block_size=16, kv_memory_bytes=60 * per_block,
                                 host_kv_memory_bytes=200 * per_block, seed=3,
                                 knobs=Knobs(max_num_batched_tokens=512, max_num_seqs=4)), ex)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}")
    publisher = EventPublisher(config, 16).start().attach(engine)
    sub = Subscriber(config.endpoint).start()
    time.sleep(0.3)
    try:
        # Groups of requests sharing prefixes, more than the device holds: the older
        # prefixes are demoted to the host, and a later group brings one back.
        arrivals = [Arrival(0.05 * i, 200, 4, prefix_group=f"g{i % 5}", prefix_len=160)
                    for i in range(30)]
        run_arrivals(engine, arrivals, vocab_size=32_000)
        engine.check_integrity()
        tree = engine.kv.tree
        assert tree.num_demotions > 0
        wait_for(sub, publisher.seq)
        cache, status = sub.snapshot()
        assert status.gaps == () and status.bad == 0

        def chain(node):
            tokens = ()
            while node is not None and node.key:
                tokens, node = node.key + tokens, node.parent
            return tokens
        device = {chain(n) for n in tree.nodes.values() if not n.on_host}
        host = {chain(n) for n in tree.nodes.values() if n.on_host}
        assert host and device

        assert subscriber_chains(cache, "GPU", only=True) == device
        assert subscriber_chains(cache, "CPU", only=True) == host
    finally:
        sub.stop()
        publisher.close()
