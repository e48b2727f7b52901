"""`kvdeck serve` started as a user starts it: a subprocess on 127.0.0.1, any free port."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Server:
    """A running `kvdeck serve` process and its base URL (ending in /v1)."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url


def sim_process(*args: str, env: dict | None = None):
    """Run `kvdeck serve --executor sim --port 0 ARGS` as a user would."""
    return serve_process("--executor", "sim", *args, env=env)


@contextmanager
def serve_process(*args: str, env: dict | None = None,
                  start_timeout_s: float = 60) -> Iterator[Server]:
    """Run `kvdeck serve --port 0 ARGS` as a user would."""
    proc = subprocess.Popen([sys.executable, "-m", "kvdeck.console.cli", "serve",
                             "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        url = None
        end = time.monotonic() + start_timeout_s
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < end, "the server did not start"
            m = re.search(r"serving .+? on (http://127\.0\.0\.1:\d+/v1)", line)
            url = m.group(1) if m else None
        yield Server(proc, url)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(30)


@contextmanager
def in_process(session) -> Iterator:
    """An `ApiServer` for `session` on 127.0.0.1, any free port, in this process; stopped
    afterwards, its engine's integrity checked."""
    from kvdeck.runtime.server.serve import ApiServer

    srv = ApiServer(session, port=0).start()
    try:
        yield srv
    finally:
        srv.stop()
        srv.engine.check_integrity()


@contextmanager
def sim_in_process() -> Iterator:
    """`in_process` for the simulated card, served as model `sim`."""
    from kvdeck.runtime.session import build_session
    from kvdeck.runtime.settings import resolve

    with in_process(build_session(resolve({"executor": "sim", "served_model_name": "sim"}),
                                  live=True)) as srv:
        yield srv


def idle(server, timeout: float = 60) -> None:
    """Wait until an in-process server's published snapshot shows an idle engine (what
    /metrics reads)."""
    end = time.monotonic() + timeout
    while True:
        snap = server.loop.latest
        if snap is not None and not snap.running and not snap.waiting and \
                snap.step == server.engine.step_count and not server.engine.has_work:
            return
        assert time.monotonic() < end
        time.sleep(0.05)
