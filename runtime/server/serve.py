"""Running the API: the engine loop in its thread, uvicorn in the foreground (or in a
background thread, for tests and the console).

Shutdown has a deadline. The first SIGINT or SIGTERM stops accepting connections and lets
running requests finish for at most `shutdown_timeout_s`; then the rest are aborted, their
clients told why (an error event, or a 503), the engine thread stopped, and the process
exits 0 without a traceback. A second signal aborts everything at once and exits.

A connection must deliver its request headers within `header_timeout_s` of connecting (or
of sending its first byte after a finished request), so a client that trickles headers
cannot hold a connection open; bodies have their own read timeout in `guard.py`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Generator

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvdeck.runtime.runs.loop import EngineLoop, SharedBusy
from kvdeck.runtime.server.app import Served, ServeLimits, create_app
from kvdeck.runtime.server.cascade import CascadeConfig
from kvdeck.runtime.session import Session


class HeaderTimedH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers do not arrive in
    time (uvicorn itself only times out idle keep-alive connections)."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle and self._header_timer is not None:  # headers arrived
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


class KvdeckServer(uvicorn.Server):
    """uvicorn's server with kvdeck's shutdown: a drain deadline, then aborts."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float,
                 abort_all: Callable[[str], None]):
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.abort_all = abort_all
        self._drain: threading.Timer | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: abort everything, exit within a second
            self.abort_all("the server was stopped")
            # The aborted streams end with their error event at the engine's next step; a
            # connection still open a second later is cut.
            force = threading.Timer(1.0, setattr, args=(self, "force_exit", True))
            force.daemon = True
            force.start()
            return
        self.should_exit = True
        self._drain = threading.Timer(
            self.shutdown_timeout_s, self.abort_all,
            args=(f"the server shut down and its {self.shutdown_timeout_s:g}-s drain "
                  "ended",))
        self._drain.daemon = True
        self._drain.start()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises a captured signal after shutting down (exit 130 or 143); here a
        # signal asked for a clean shutdown, and that is what happened: exit 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # a hang-up drains too
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
            if self._drain is not None:
                self._drain.cancel()


class ApiServer:
    """Engine loops plus an HTTP server on `host:port` (127.0.0.1 unless asked)."""

    def __init__(self, session: Session, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, loop: EngineLoop | None = None,
                 limits: ServeLimits = ServeLimits(), shutdown_timeout_s: float = 5.0,
                 header_timeout_s: float = 10.0, others: tuple[Session, ...] = (),
                 cascade: CascadeConfig | None = None):
        """`loop`: an engine loop someone else runs (the console's) for `session`; by
        default the server runs its own. `others`: more models served beside `session`'s,
        each on its own engine and loop (`kvdeck serve --model A --model B`); `cascade`
        names two of them."""
        self.session = session
        self.sessions = [session, *others]
        self.engine = session.engine
        self.owns_loop = loop is None
        self.loop = loop or EngineLoop(session.engine)
        self.loops = [self.loop, *(EngineLoop(s.engine) for s in others)]
        self.busy = SharedBusy()  # the models share this machine's device
        for lp in self.loops:
            lp.busy = self.busy
        self.served = [Served(s.model_id, s.engine, s.tokenizer, lp, s.settings,
                              dict(s.adapters))
                       for s, lp in zip(self.sessions, self.loops, strict=True)]
        self.app = create_app(self.served, api_key=api_key, limits=limits, cascade=cascade,
                              busy=self.busy)
        protocol = type("Protocol", (HeaderTimedH11,), {"header_timeout_s": header_timeout_s})
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                http=protocol, lifespan="off",
                                timeout_graceful_shutdown=shutdown_timeout_s + 5)
        self.server = KvdeckServer(config, shutdown_timeout_s, self.abort_all)
        self._thread: threading.Thread | None = None

    @property
    def own_loops(self) -> list[EngineLoop]:
        """The loops this server starts and stops (all but a console's)."""
        return self.loops if self.owns_loop else self.loops[1:]

    def abort_all(self, reason: str) -> None:
        """Abort every request a client is waiting on (any thread)."""
        for s in self.served:
            for rid in s.hub.watched_ids():
                s.engine.abort(rid, reason)

    def run(self, on_listening: Callable[[int], None] | None = None) -> None:
        """Serve in the foreground until a signal; `on_listening(port)` once listening."""
        for loop in self.loops:
            loop.start()
        if on_listening is not None:
            def announce() -> None:
                while not self.server.started and not self.server.should_exit:
                    time.sleep(0.02)
                if self.server.started:
                    on_listening(self.port)

            threading.Thread(target=announce, daemon=True).start()
        try:
            self.server.run()
        finally:
            for loop in self.loops:
                loop.stop()
            for s in self.sessions:
                s.close()

    def start(self) -> ApiServer:
        """Serve from a background thread; returns once the socket is listening."""
        for loop in self.own_loops:
            loop.start()
        self._thread = threading.Thread(target=self.server.run, name="kvdeck-http",
                                        daemon=True)
        self._thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("the HTTP server did not start within 30 s")

    @property
    def port(self) -> int:
        sockets = self.server.servers[0].sockets if self.server.servers else []
        return sockets[0].getsockname()[1] if sockets else self.server.config.port

    def stop(self) -> None:
        """Stop serving: clients still waiting get an error, then the threads end."""
        self.abort_all("the server was stopped")
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        for loop in self.own_loops:
            loop.stop()
        for s in self.sessions[1:]:  # the models served beside the caller's (theirs: the
            s.close()                # caller closes it, or the console does)
        self.app.app.state.tokenizing.shutdown(wait=False)
        forget_routes()


def forget_routes() -> None:
    """Empty FastAPI's module-level caches of endpoint callables (`lru_cache`s of up to
    4,096 entries in `fastapi.dependencies.models`): they keep every stopped app's route
    closures, and through them its engine and model, alive for the life of the process
    (a test run that starts servers in-process held 1.2 GB per server)."""
    from fastapi.dependencies import models

    for value in vars(models).values():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()
