"""`make screenshots`: deterministic sim runs rendered to SVG for the README.

The same seeded app drives the UI snapshot tests (`tests/ui`), so the pictures show what the
tests check.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from console.app import KvdeckApp
from runtime.config import EngineConfig, Knobs
from runtime.engine import Engine
from runtime.executors.sim import SimConfig, SimExecutor
from runtime.recording import Recorder
from runtime.traffic import TrafficGenerator, TrafficMix


def make_demo_app(runs_dir: Path | None = None, autostart: bool = False) -> KvdeckApp:
    """Qwen3-8B on the simulated RTX PRO 6000, seed 3, 4 GiB of KV, 6 requests/s."""
    engine = Engine(EngineConfig(kv_memory_bytes=4 << 30, seed=3,
                                 knobs=Knobs(max_num_batched_tokens=4096, chunk_size=1024)),
                    SimExecutor(SimConfig(), seed=3))
    traffic = TrafficGenerator(engine, TrafficMix.for_context(32768, rate_per_s=6.0),
                               vocab_size=32_000, seed=3)
    kwargs = {"runs_dir": runs_dir} if runs_dir is not None else {}
    return KvdeckApp(engine, traffic, autostart=autostart, hardware=False, **kwargs)


def advance(app: KvdeckApp, steps: int) -> None:
    """Run `steps` iterations with traffic on the caller's thread, then render."""
    for _ in range(steps):
        app.traffic(app.engine)
        app.engine.step()
        app.engine.check_integrity()
    app.render_snapshot(app.engine.snapshot())


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
    from console.screens.replay import ReplayApp

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
             ((160, 48), 0, ["f1"], "help-160x48.svg")]
    for size, steps, keys, name in shots:
        asyncio.run(_shoot(out, size, steps, keys, name))
        print(f"wrote {out / name}")
    with tempfile.TemporaryDirectory() as tmp:  # record a seeded run, then replay it
        app = make_demo_app(Path(tmp))
        recorder = Recorder(Path(tmp) / "run", app.engine)
        for _ in range(120):
            app.traffic(app.engine)
            app.engine.step()
        recorder.close()
        asyncio.run(_shoot_replay(out, Path(tmp) / "run", "replay-160x48.svg"))
    print(f"wrote {out / 'replay-160x48.svg'}")


if __name__ == "__main__":
    main()
