"""Running the API: the engine loop in its thread, uvicorn in the foreground (or in a
background thread, for tests and the console)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import uvicorn

from runtime.engine_loop import EngineLoop
from runtime.server.app import create_app
from runtime.session import Session


class ApiServer:
    """An engine loop plus a uvicorn server on `host:port` (127.0.0.1 unless asked)."""

    def __init__(self, session: Session, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, loop: EngineLoop | None = None):
        """`loop`: an engine loop someone else runs (the console's); by default the server
        runs its own."""
        self.session = session
        self.engine = session.engine
        self.owns_loop = loop is None
        self.loop = loop or EngineLoop(session.engine)
        self.app = create_app(session.engine, session.tokenizer, session.model_id, self.loop,
                              api_key=api_key, settings=session.settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port,
                                                    log_level="warning"))
        self._thread: threading.Thread | None = None

    def run(self, on_listening: Callable[[int], None] | None = None) -> None:
        """Serve in the foreground until interrupted; `on_listening(port)` once the socket
        listens."""
        self.loop.start()
        if on_listening is not None:
            def announce() -> None:
                while not self.server.started and not self.server.should_exit:
                    time.sleep(0.02)
                if self.server.started:
                    on_listening(self.port)

            threading.Thread(target=announce, daemon=True).start()
        try:
            self.server.run()
        except KeyboardInterrupt:
            pass  # uvicorn re-raises the SIGINT it shut down on: the shutdown was asked for
        finally:
            self.loop.stop()
            self.session.close()

    def start(self) -> ApiServer:
        """Serve from a background thread; returns once the socket is listening."""
        if self.owns_loop:
            self.loop.start()
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
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        if self.owns_loop:
            self.loop.stop()
