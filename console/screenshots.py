"""`make screenshots`: deterministic sim runs rendered to SVG for the README.

The same seeded app drives the UI snapshot tests (`tests/ui`), so the pictures show what the
tests check.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvdeck.console.app import KvdeckApp
from kvdeck.runtime.runs.recording import record_headless
from kvdeck.runtime.runs.traffic import TrafficGenerator
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve
from kvdeck.runtime.views.snapshot import snapshot_of


def make_demo_app(runs_dir: Path | None = None, autostart: bool = False,
                  **settings) -> KvdeckApp:
    """Qwen3-8B on the simulated RTX PRO 6000, seed 3, 4 GiB of KV, 6 requests/s, stand-in
    tokenizer. With `autostart` the engine loop runs paced to the wall clock, as in
    `kvdeck console --executor sim`; without, the caller steps it (`advance`). `settings`
    override the demo's."""
    resolved = resolve({"executor": "sim", "kv_memory_bytes": 4 << 30, "seed": 3,
                        "max_num_batched_tokens": 4096, "chunk_size": 1024, **settings})
    session = build_session(resolved, live=autostart)
    traffic = TrafficGenerator.for_engine(session.engine, 6.0)
    kwargs = {"runs_dir": runs_dir} if runs_dir is not None else {}
    return KvdeckApp(session.engine, traffic, autostart=autostart, hardware=False,
                     settings=resolved, **kwargs)


def advance(app: KvdeckApp, steps: int) -> None:
    """Run `steps` iterations with traffic on the caller's thread, then render."""
    for _ in range(steps):
        app.traffic(app.engine)
        app.engine.step()
        app.engine.check_integrity()
    app.render_snapshot(snapshot_of(app.engine))


async def _shoot(out: Path, size: tuple[int, int], steps: int, keys: list[str], name: str):
    app = make_demo_app()
    async with app.run_test(size=size) as pilot:
        advance(app, steps)
        await pilot.pause()
        for key in keys:
            await pilot.press(key)
        await pilot.pause()
        app.save_screenshot(filename=name, path=str(out))


async def _shoot_replay(out: Path, run_dir: Path, name: str) -> None:
    from kvdeck.console.screens.replay import ReplayApp

    app = ReplayApp(run_dir)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("pagedown")
        await pilot.pause()
        app.save_screenshot(filename=name, path=str(out))


async def _shoot_fleet(out: Path) -> None:
    """The fleet screen on two sim servers publishing KV events and a URL where nothing
    answers, after shared-prefix traffic, with a prompt scored by the router."""
    import random
    import socket

    import httpx

    from kvdeck.console.screens.fleet import FleetApp
    from kvdeck.runtime.fleet.fleet import Fleet, ReplicaSpec
    from kvdeck.runtime.fleet.publisher import EventPublisher, KVEventsConfig
    from kvdeck.runtime.server.serve import ApiServer
    from kvdeck.runtime.session import build_session
    from kvdeck.runtime.settings import resolve

    def port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    servers, publishers, specs = [], [], []
    for name in ("replica-a", "replica-b"):
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port()}",
                                replay_endpoint=f"tcp://*:{port()}")
        session = build_session(resolve({"executor": "sim", "served_model_name": "sim"}),
                                live=True)
        publishers.append(EventPublisher(config, 16).start().attach(session.engine))
        servers.append(ApiServer(session, port=0).start())
        specs.append(ReplicaSpec(name, f"http://127.0.0.1:{servers[-1].port}",
                                 config.endpoint, config.replay_endpoint))
    specs.append(ReplicaSpec("replica-c", f"http://127.0.0.1:{port()}"))
    rng = random.Random(4)
    system = [rng.randrange(100, 30_000) for _ in range(96)]
    try:
        for size, name in (((160, 48), "fleet-160x48.svg"), ((80, 24), "fleet-80x24.svg")):
            app = FleetApp(Fleet(specs, 0.3), 0.3)
            async with app.run_test(size=size) as pilot:
                await pilot.pause(0.6)
                async with httpx.AsyncClient(timeout=60) as client:
                    for i in range(6):
                        own = [rng.randrange(100, 30_000) for _ in range(24 + 8 * i)]
                        await client.post(f"{specs[i % 2 if i < 4 else 0].url}/v1/completions",
                                          json={"model": "sim", "prompt": system + own,
                                                "max_tokens": 4})
                await pilot.pause(2.0)
                box = app.query_one("#router-prompt")
                box.focus()
                box.value = " ".join(map(str, system + [7] * 40))
                await pilot.press("enter")
                await pilot.pause(0.6)
                app.save_screenshot(filename=name, path=str(out))
            print(f"wrote {out / name}")
        await _shoot_attach(out, specs[0])
    finally:
        for srv in servers:
            srv.stop()
        for pub in publishers:
            pub.close()


async def _shoot_attach(out: Path, spec) -> None:
    """`kvdeck attach` on one of the fleet's replicas with its KV events: the prefix tree
    panel drawing the replica's cached segments, decoded."""
    from kvdeck.console.screens.attach import AttachApp
    from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
    from kvdeck.runtime.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(DEFAULT_MODEL))
    for size, name in (((160, 48), "attach-160x48.svg"), ((80, 24), "attach-80x24.svg")):
        app = AttachApp(spec.url, 0.3, kv_events=spec.kv_events, kv_replay=spec.kv_replay,
                        tokenizer=tokenizer)
        async with app.run_test(size=size) as pilot:
            await pilot.pause(2.0)
            app.save_screenshot(filename=name, path=str(out))
        print(f"wrote {out / name}")


def main(out: Path = Path("screenshots")) -> None:
    import tempfile

    out.mkdir(exist_ok=True)
    shots = [((160, 48), 60, [], "live-160x48.svg"), ((80, 24), 60, [], "live-80x24.svg"),
             ((160, 48), 60, ["n"], "live-highlight-160x48.svg"),
             ((160, 48), 0, ["f1"], "help-160x48.svg"),
             ((160, 48), 300, ["l"], "requests-160x48.svg"),
             ((160, 48), 300, ["c"], "charts-160x48.svg")]
    for size, steps, keys, name in shots:
        asyncio.run(_shoot(out, size, steps, keys, name))
        print(f"wrote {out / name}")
    with tempfile.TemporaryDirectory() as tmp:  # record a seeded run, then replay it
        app = make_demo_app(Path(tmp))
        recorder = record_headless(app.engine, Path(tmp) / "run")
        for _ in range(120):
            app.traffic(app.engine)
            app.engine.step()
        recorder.close()
        asyncio.run(_shoot_replay(out, Path(tmp) / "run", "replay-160x48.svg"))
    print(f"wrote {out / 'replay-160x48.svg'}")
    asyncio.run(_shoot_fleet(out))


if __name__ == "__main__":
    main()
