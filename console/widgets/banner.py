"""A one-line banner for what an operator must not miss: the engine stopped on an error
(with where the full traceback was written), or the engine is paused."""

from __future__ import annotations

from textual.widgets import Static

from kvdeck.runtime.views.snapshot import EngineSnapshot


class Banner(Static):
    DEFAULT_CSS = """
    Banner { height: auto; padding: 0 1; display: none; }
    Banner.-failed { display: block; background: $error; color: $text; text-style: bold; }
    Banner.-paused { display: block; background: $warning; color: $text; }
    """

    def show(self, snap: EngineSnapshot) -> None:
        failed = snap.failure is not None
        self.set_class(failed, "-failed")
        self.set_class(snap.paused and not failed, "-paused")
        if failed:
            where = f" The full traceback is in {snap.failure.log_path}." \
                if snap.failure.log_path else ""
            self.update(f"The engine stopped: {snap.failure.message}. Every pending request "
                        f"was aborted; q quits.{where}")
        elif snap.paused:
            self.update("Paused: no iterations run (s steps one, p resumes); API requests "
                        "queue until it resumes and /health says paused.")
