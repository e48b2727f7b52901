"""`make demo` as a user runs it: in a terminal (a pseudo-terminal here), the console opens on
the embedded model with traffic flowing, draws its panels, and quits cleanly on `q`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.terminal import Terminal

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_make_demo_opens_the_console_and_q_quits() -> None:
    term = Terminal(["make", "-s", "demo"], cwd=str(REPO))
    try:
        screen = term.read(240, until=(b"KV blocks", b"Prefix cache", b"Knobs"))
        assert b"KV blocks" in screen and b"Knobs" in screen, screen[-2000:]
        term.read(3)  # let traffic arrive and a few iterations run
        term.press("q")
        status = term.wait(60)
    finally:
        term.close()
    assert status is not None, "the console did not exit within 60 s of q"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.slow
@pytest.mark.parametrize("how, executor", [("q", None), ("SIGINT", None), ("SIGTERM", None),
                                          ("SIGTERM", "torch")])
def test_the_console_on_the_real_model_under_load_quits_cleanly(tmp_path, how: str,
                                                                 executor: str | None) -> None:
    """Gemma 3 270M at 20 arrivals/s (the queue grows faster than the CPU drains it) on the
    executor the machine chooses (llama_cpp here) and on torch, then q, SIGINT or SIGTERM
    mid-step: the API-less console stops the engine after its step, the recorder and the
    executor's native resources in order — exit 0, no native abort."""
    import signal
    import sys

    chosen = ["--executor", executor] if executor else []
    term = Terminal([sys.executable, "-m", "kvdeck.console.cli", "console", "--rate", "20",
                     *chosen], cwd=str(tmp_path))
    try:
        assert b"Knobs" in term.read(240, until=(b"KV blocks", b"Knobs"))
        term.press("r")  # a recorder attached too: it must be closed in order
        term.read(8)  # load builds up: long prefills, a growing queue (160 arrivals)
        if how == "q":
            term.press("q")
        else:
            os.kill(term.pid, getattr(signal, how))
        status = term.wait(120)
    finally:
        term.close()
    screen = term.screen.decode("utf-8", errors="replace")
    assert status is not None, f"the console did not exit within 120 s of {how}"
    assert "terminate called" not in screen and "Traceback" not in screen
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, screen[-2000:])
    (run,) = (tmp_path / "runs").iterdir()  # the recording was closed, whole
    assert (run / "iterations.jsonl").read_text().endswith("\n")
