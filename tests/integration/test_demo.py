"""`make demo` as a user runs it: in a terminal (a pseudo-terminal here), the console opens on
the embedded model with traffic flowing, draws its panels, and quits cleanly on `q`."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import termios
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def read_until(fd: int, needles: tuple[bytes, ...], timeout: float) -> bytes:
    """Read the terminal until every needle has appeared (or EOF / timeout)."""
    seen = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end and not all(n in seen for n in needles):
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    return seen


@pytest.mark.slow
def test_make_demo_opens_the_console_and_q_quits() -> None:
    status = None
    pid, fd = pty.fork()
    if pid == 0:  # the child: a user typing `make demo` at 160×48
        os.chdir(REPO)
        os.execvpe("make", ["make", "-s", "demo"],
                   {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "48"})
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 48, 160, 0, 0))
    try:
        screen = read_until(fd, (b"KV blocks", b"Prefix cache", b"Knobs"), timeout=240)
        assert b"KV blocks" in screen and b"Knobs" in screen, screen[-2000:]
        time.sleep(3)  # let traffic arrive and a few iterations run
        os.write(fd, b"q")
        read_until(fd, (b"never printed",), timeout=60)  # drain the screen until it exits
        status = None
        end = time.monotonic() + 30
        while status is None and time.monotonic() < end:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = code if done else None
            time.sleep(0.1)
    finally:
        if status is None:  # still running: a hang, which the assertion below reports
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    assert status is not None, "the console did not exit within 30 s of q"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
