"""The routing panel of `kvdeck serve --cascade SMALL,LARGE --console`, drawn from the
cascade's own statistics as the server records them."""

from __future__ import annotations

from kvdeck.console.screenshots import make_demo_app
from kvdeck.console.widgets.routing import RoutingPanel
from kvdeck.runtime.server.cascade import CascadeConfig, CascadeStats
from tests.ui.panel_text import panel_text


def served_stats() -> CascadeStats:
    stats = CascadeStats(CascadeConfig("qwen-small", "qwen-large", threshold=0.5))
    for confidence in (0.95, 0.91, 0.72):  # answered by the small model, 0.2 s each
        stats.record("small", confidence, True, 0.2, 0.0, 0.25, 0.0)
    stats.record("escalated-confidence", 0.31, True, 0.2, 0.6, 0.25, 0.7)
    return stats


async def test_routes_confidence_and_savings_are_shown(tmp_path) -> None:
    stats = served_stats()
    app = make_demo_app(tmp_path / "runs")
    app.routing = stats.view
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        panel = app.query_one(RoutingPanel)
        text = " ".join(panel_text(panel).split())
        assert "4 requests · escalated 25%" in text
        assert "escalate when min-prob < 0.5" in text
        assert "small 3 req · 3 good" in text and "0.20 s/good" in text
        assert "unsure → large 1 req · 1 good" in text and "0.80 s/good" in text
        # All-large: 0.6 s a request (the ratio 3× measured on the escalated one) × 3.
        assert "saved vs all-large: 1.0 accel s" in text
        assert panel.border_subtitle == "cascade: qwen-small → qwen-large"
        histogram = next(line for line in panel_text(panel).splitlines()
                         if "confidence 0" in line)
        assert histogram.index("|") < histogram.index("█")  # the mass above the threshold


async def test_the_console_has_no_routing_panel_without_a_cascade(tmp_path) -> None:
    app = make_demo_app(tmp_path / "runs")
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        assert not app.query(RoutingPanel)
