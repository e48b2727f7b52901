"""The fleet: two kvdeck servers publishing KV events and a URL where nothing answers,
watched at once — rows, the fleet tree by content, router scores, a replica stopped
mid-run marked down while the other keeps updating — and the fleet screen drawing them."""

from __future__ import annotations

import random
import socket
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from kvdeck.console.screens.fleet import FleetApp
from kvdeck.runtime.errors import ConfigError, KvdeckError
from kvdeck.runtime.fleet.fleet import Fleet, ReplicaSpec, delta, load_fleet
from kvdeck.runtime.fleet.publisher import EventPublisher, KVEventsConfig
from kvdeck.runtime.runs.attach import Histogram
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from tests.servers import idle, in_process

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica(stack: ExitStack, name: str) -> tuple[ReplicaSpec, object]:
    """A kvdeck sim server publishing its KV events; its spec as a fleet file gives it."""
    pub, replay = free_port(), free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub}",
                            replay_endpoint=f"tcp://*:{replay}")
    session = build_session(resolve({"executor": "sim", "served_model_name": "sim"}),
                            live=True)
    publisher = EventPublisher(config, session.engine.kv.block_size).start()
    publisher.attach(session.engine)
    stack.callback(publisher.close)
    srv = stack.enter_context(in_process(session))
    return ReplicaSpec(name, f"http://127.0.0.1:{srv.port}", config.endpoint,
                       config.replay_endpoint), srv


def send(srv, prompt: list[int]) -> None:
    r = httpx.post(f"http://127.0.0.1:{srv.port}/v1/completions", timeout=60,
                   json={"model": "sim", "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text


def until(check, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def test_a_fleet_of_two_servers_and_a_dead_url() -> None:
    rng = random.Random(5)
    shared = [rng.randrange(100, 30_000) for _ in range(4 * BLOCK)]
    with ExitStack() as stack:
        (a, srv_a), (b, srv_b) = replica(stack, "a"), replica(stack, "b")
        dead = ReplicaSpec("dead", f"http://127.0.0.1:{free_port()}")
        fleet = Fleet([a, b, dead], interval_s=0.2).start()
        stack.callback(fleet.stop)
        time.sleep(0.3)  # the subscribers' connections are asynchronous
        own = {}
        for name, srv in (("a", srv_a), ("b", srv_b)):
            own[name] = [rng.randrange(100, 30_000) for _ in range(2 * BLOCK)]
            send(srv, shared + own[name])
            idle(srv)
        until(lambda: all(len(c.blocks) == 6 for c in fleet.caches().values()))
        until(lambda: [r.state for r in fleet.rows()] == ["up", "up", "down"])
        rows = {r.name: r for r in fleet.rows()}
        assert rows["dead"].said.startswith("nothing answers at")
        assert rows["a"].status.engine == "kvdeck" and rows["a"].events.messages >= 1
        # One fleet tree: the shared prefix held by both, each one's own tail by itself.
        tree = fleet.tree()
        both = [n for n in tree.values() if set(n.replicas) == {"a", "b"}]
        assert b"".join(sorted(n.key for n in both)) and len(both) == 4
        assert sorted(n.tokens for n in both) == sorted(
            tuple(shared[i:i + BLOCK]) for i in range(0, len(shared), BLOCK))
        scores = fleet.scores(shared + own["a"])
        assert scores["a"].blocks == 6 and scores["b"].blocks == 4
        # b stops: its row goes down in a few scrapes; a keeps updating.
        srv_b.stop()
        until(lambda: fleet.rows()[1].state == "down")
        before = fleet.rows()[0].events.messages
        send(srv_a, [rng.randrange(100, 30_000) for _ in range(3 * BLOCK)])
        until(lambda: fleet.rows()[0].events.messages > before)
        assert fleet.rows()[0].state == "up"


async def test_the_fleet_screen_draws_rows_tree_and_scores() -> None:
    rng = random.Random(6)
    shared = [rng.randrange(100, 30_000) for _ in range(2 * BLOCK)]
    with ExitStack() as stack:
        (a, srv_a), (b, srv_b) = replica(stack, "a"), replica(stack, "b")
        fleet = Fleet([a, b], interval_s=0.2)
        app = FleetApp(fleet, interval_s=0.2)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)
            for srv in (srv_a, srv_b):
                send(srv, shared + [rng.randrange(100, 30_000) for _ in range(BLOCK)])
            end = time.monotonic() + 20
            while "a:GPU b:GPU" not in str(app.query_one("#fleet-tree").render()):
                assert time.monotonic() < end, str(app.query_one("#fleet-tree").render())
                await pilot.pause(0.2)
            table = app.query_one("#replicas")
            assert table.row_count == 2
            assert str(table.get_cell_at((0, 1))) == "up"
            box = app.query_one("#router-prompt")
            box.focus()
            box.value = " ".join(map(str, shared))
            await pilot.press("enter")
            await pilot.pause(0.3)
            scores = str(app.query_one("#router-scores").render())
            assert "a: 2.0 (2 blocks, 32 tokens)" in scores and "b: 2.0" in scores


def test_fleet_files_and_their_mistakes(tmp_path: Path) -> None:
    good = tmp_path / "fleet.toml"
    good.write_text('[[replica]]\nurl = "http://10.0.0.1:8000"\nkv_events = "tcp://*:5557"\n'
                    '[[replica]]\nname = "b"\nurl = "http://10.0.0.2:8000"\n')
    specs = load_fleet(good)
    assert [(s.name, s.kv_events) for s in specs] == [("10.0.0.1:8000", "tcp://*:5557"),
                                                      ("b", None)]
    for text, said in (("", "lists no replicas"), ('[[replica]]\nname = "x"\n', "needs a url"),
                       ('[[replica]]\nurl = "http://h:1"\nport = 2\n', "no field 'port'"),
                       ('[[replica]]\nurl = "http://h:1"\n[[replica]]\nurl = "http://h:1"\n',
                        "names must differ"), ("[[replica", "Cannot read")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=said):
            load_fleet(bad)
    with pytest.raises(KvdeckError, match="is not a server URL"):
        ReplicaSpec.of_url("ftp://x")


def test_histogram_deltas_are_the_recent_observations() -> None:
    before = Histogram([(0.1, 5), (1.0, 10), (float("inf"), 10)], 3.0, 10)
    after = Histogram([(0.1, 5), (1.0, 30), (float("inf"), 30)], 13.0, 30)
    recent = delta(before, after)
    assert recent.count == 20 and recent.quantile(0.5) == pytest.approx(0.55)
    assert delta(after, before) is None  # the server restarted


async def test_attach_draws_a_replicas_events_in_the_prefix_tree_panel(gemma_path) -> None:
    """`kvdeck attach URL --kv-events`: the replica's cached segments in the same prefix
    tree panel kvdeck's own engine uses, span, medium and text decoded, a prompt sharing
    the first one's prefix a child of the shared segment."""
    import asyncio

    from kvdeck.console.screens.attach import AttachApp
    from kvdeck.console.widgets.prefix_tree import PrefixTreePanel
    from kvdeck.runtime.text.tokenizer import Tokenizer

    rng = random.Random(7)
    shared = [rng.randrange(100, 30_000) for _ in range(2 * BLOCK)]
    tok = Tokenizer(gemma_path)
    with ExitStack() as stack:
        spec, srv = replica(stack, "a")
        app = AttachApp(spec.url, interval_s=0.2, kv_events=spec.kv_events,
                        kv_replay=spec.kv_replay, tokenizer=tok)
        async with app.run_test(size=(160, 48)):
            for _ in range(2):
                send(srv, shared + [rng.randrange(100, 30_000) for _ in range(BLOCK + 1)])
                idle(srv)
            tree = app.query_one(PrefixTreePanel)
            for _ in range(100):
                await asyncio.sleep(0.1)
                if tree.display and len(tree.root.children) == 1 and \
                        len(tree.root.children[0].children) == 2:
                    break
            (shared_node,) = tree.root.children
            label = str(shared_node.label)
            assert label.startswith(f"[0:{2 * BLOCK}) 2 blocks GPU group 0 “")
            assert "“" + tok.decode(shared).replace("\n", "⏎")[:6] in label
            assert [str(c.label).split()[0] for c in shared_node.children] == \
                [f"[{2 * BLOCK}:{3 * BLOCK})"] * 2
            assert tree.border_subtitle == "3 segments"
