"""The console on the seeded sim run that `make screenshots` also uses."""

from __future__ import annotations

import pytest

from kvdeck.console.app import KvdeckApp
from kvdeck.console.screenshots import make_demo_app


@pytest.fixture()
def app(tmp_path) -> KvdeckApp:
    app = make_demo_app(tmp_path / "runs")
    # Tests read the notifications afterwards: keep them however slow the machine (after
    # Textual's 5 s the first of three knob edits' notes had gone on a slow VM).
    app.NOTIFICATION_TIMEOUT = 3600
    return app
