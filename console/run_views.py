"""Rich rendering of `kvdeck run-trace` summaries and `kvdeck compare` tables."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# (label, path into the summary, unit scale, format, higher is better?)
ROWS: list[tuple[str, tuple[str, ...], float, str, bool | None]] = [
    ("requests", ("num_requests",), 1, "{:,.0f}", None),
    ("makespan (s)", ("makespan_s",), 1, "{:,.2f}", False),
    ("completion throughput (req/s)", ("completion_throughput_rps",), 1, "{:,.3f}", True),
    ("goodput (req/s)", ("goodput_rps",), 1, "{:,.3f}", True),
    ("output tokens/s", ("output_tokens_per_s",), 1, "{:,.1f}", True),
    ("TTFT p50 (ms)", ("ttft_s", "p50"), 1e3, "{:,.1f}", False),
    ("TTFT p99 (ms)", ("ttft_s", "p99"), 1e3, "{:,.1f}", False),
    ("TPOT p50 (ms)", ("tpot_s", "p50"), 1e3, "{:,.2f}", False),
    ("TPOT p99 (ms)", ("tpot_s", "p99"), 1e3, "{:,.2f}", False),
    ("ITL p50 (ms)", ("itl_s", "p50"), 1e3, "{:,.2f}", False),
    ("ITL p99 (ms)", ("itl_s", "p99"), 1e3, "{:,.2f}", False),
    ("E2E p50 (s)", ("e2e_s", "p50"), 1, "{:,.3f}", False),
    ("E2E p99 (s)", ("e2e_s", "p99"), 1, "{:,.3f}", False),
    ("queue p50 (s)", ("queue_s", "p50"), 1, "{:,.3f}", False),
    ("TTFT from send p50 (ms)", ("ttft_from_send_s", "p50"), 1e3, "{:,.1f}", False),
    ("prefix hit rate (%)", ("prefix_hit_rate",), 100, "{:,.1f}", True),
    ("preemptions", ("num_preemptions",), 1, "{:,.0f}", False),
    ("evictions", ("num_evictions",), 1, "{:,.0f}", None),
    ("prefix blocks demoted to host", ("prefix_demotions",), 1, "{:,.0f}", None),
    ("prefix tokens hit on host", ("prefix_host_hit_tokens",), 1, "{:,.0f}", True),
    ("steps", ("steps", "count"), 1, "{:,.0f}", None),
    ("mean batch size", ("steps", "mean_batch_size"), 1, "{:,.1f}", None),
    ("mean step (ms)", ("steps", "mean_step_s"), 1e3, "{:,.2f}", None),
    ("mean resident (measured)", ("littles_law", "measured_mean_resident"), 1, "{:,.2f}", None),
    ("mean resident (λ·T, Little)", ("littles_law", "predicted_mean_resident"), 1, "{:,.2f}",
     None),
    ("accelerator s per good result", ("accelerator_s_per_good_result",), 1, "{:,.4f}", False),
    ("finish forecast |error| (%)", ("finish_forecast_error",), 100, "{:,.2f}", False),
]

CHECK_ROWS: list[tuple[str, tuple[str, ...], float, str, bool | None]] = [
    ("answers checked", ("num_checked",), 1, "{:,.0f}", None),
    ("answers correct", ("num_correct",), 1, "{:,.0f}", True),
    ("retries", ("retries",), 1, "{:,.0f}", False),
    ("requests answered correctly", ("answered_correctly",), 1, "{:,.0f}", True),
    ("time to correct p50 (s)", ("time_to_correct_s", "p50"), 1, "{:,.3f}", False),
    ("time to correct p99 (s)", ("time_to_correct_s", "p99"), 1, "{:,.3f}", False),
]
"""Answer checks and `kvdeck bench --retries`: shown where a run checked answers or retried."""


def lookup(summary: dict, path: tuple[str, ...]) -> float | None:
    value = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, (int, float)) else None


def fmt(value: float | None, scale: float, pattern: str) -> str:
    return "—" if value is None else pattern.format(value * scale)


def checked(*summaries: dict) -> bool:
    """Whether any of the runs checked answers or retried requests."""
    return any(s.get("num_checked") or s.get("retries") for s in summaries)


def render_summary(console: Console, title: str, summary: dict) -> None:
    table = Table(title=escape(title))
    table.add_column("metric")
    table.add_column("value", justify="right")
    statuses = ", ".join(f"{k} {v:,}" for k, v in sorted(summary.get("statuses", {}).items()))
    table.add_row("statuses", statuses or "—")
    for label, path, scale, pattern, _ in ROWS + (CHECK_ROWS if checked(summary) else []):
        table.add_row(label, fmt(lookup(summary, path), scale, pattern))
    console.print(table)


def render_compare(console: Console, name_a: str, a: dict, name_b: str, b: dict) -> None:
    table = Table(title="kvdeck compare (Δ = B − A)")
    table.add_column("metric")
    table.add_column(f"A: {escape(name_a)}", justify="right")
    table.add_column(f"B: {escape(name_b)}", justify="right")
    table.add_column("Δ", justify="right")
    table.add_column("B/A", justify="right")
    for label, path, scale, pattern, higher_better in \
            ROWS + (CHECK_ROWS if checked(a, b) else []):
        va, vb = lookup(a, path), lookup(b, path)
        delta = ratio = "—"
        if va is not None and vb is not None:
            d = (vb - va) * scale
            style = ""
            if higher_better is not None and d != 0:
                style = "green" if (d > 0) == higher_better else "red"
            delta = f"[{style}]{pattern.format(d)}[/]" if style else pattern.format(d)
            ratio = f"{vb / va:,.3f}" if va else "—"
        table.add_row(label, fmt(va, scale, pattern), fmt(vb, scale, pattern), delta, ratio)
    console.print(table)
