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


if __name__ == "__main__":
    main()
