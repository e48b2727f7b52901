"""A program run in a pseudo-terminal, as a user runs it in theirs: keys in, screen bytes out,
and its exit status."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import termios
import time


class Terminal:
    """`argv` started in a `columns`×`lines` pseudo-terminal in `cwd`."""

    def __init__(self, argv: list[str], cwd: str, columns: int = 160, lines: int = 48,
                 env: dict | None = None):
        self.status: int | None = None
        self.screen = b""
        """Everything the program wrote, for assertions on what a user saw."""
        pid, fd = pty.fork()
        if pid == 0:  # the child
            os.chdir(cwd)
            os.execvpe(argv[0], argv, {**os.environ, **(env or {}), "TERM": "xterm-256color",
                                       "COLUMNS": str(columns), "LINES": str(lines)})
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        self.pid, self.fd = pid, fd

    def read(self, seconds: float, until: tuple[bytes, ...] = ()) -> bytes:
        """Read for `seconds` (or until every needle has appeared, or EOF); keeps draining
        so the program never blocks on a full terminal."""
        start = len(self.screen)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if until and all(n in self.screen[start:] for n in until):
                break
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                self.screen += chunk
        return self.screen[start:]

    def press(self, keys: str | bytes) -> None:
        os.write(self.fd, keys.encode() if isinstance(keys, str) else keys)

    def wait(self, timeout: float) -> int | None:
        """Drain the screen until the program exits; its wait status, or None on a hang."""
        end = time.monotonic() + timeout
        while self.status is None and time.monotonic() < end:
            self.read(0.2)
            done, code = os.waitpid(self.pid, os.WNOHANG)
            self.status = code if done else None
        return self.status

    def close(self) -> None:
        if self.status is None:  # still running: a hang, which the caller reports
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        os.close(self.fd)
