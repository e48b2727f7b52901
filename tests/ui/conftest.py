"""The console on the seeded sim run that `make screenshots` also uses."""

from __future__ import annotations

import pytest

from kvdeck.console.app import KvdeckApp
from kvdeck.console.screenshots import make_demo_app


@pytest.fixture()
def app(tmp_path) -> KvdeckApp:
    return make_demo_app(tmp_path / "runs")
