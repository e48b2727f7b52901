"""Rich rendering of a simulated fleet's run (`kvdeck run-trace --replicas`): the run's
figures as one, the fleet's own, and one row per replica."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvdeck.console.run_views import fmt, render_summary

FLEET_ROWS = [
    ("router", "router", None),
    ("replicas (prefill + decode)", "num_replicas", None),
    ("cards", "cards", "{:,.0f}"),
    ("load imbalance (max/mean tok/s)", "load_imbalance", "{:.2f}"),
    ("prefix hit rate", "prefix_hit_rate", "{:.1%}"),
    ("KV moved between instances GB", "kv_moved_bytes", "{:,.2f}"),
    ("KV transfer left after prefill (mean) ms", "transfer_s_mean", "{:,.1f}"),
    ("prefill capacity idle", "prefill_idle_share", "{:.1%}"),
    ("decode capacity idle", "decode_idle_share", "{:.1%}"),
]


def render_fleet(console: Console, title: str, result: dict) -> None:
    s = result["summary"]
    render_summary(console, title, s)
    table = Table(title="the fleet")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for label, key, pattern in FLEET_ROWS:
        value = s.get(key)
        if key == "num_replicas" and s.get("prefill_replicas"):
            text = f"{value} ({s['prefill_replicas']} + {s['decode_replicas']})"
        elif pattern is None:
            text = escape(str(value))
        else:
            scale = 1e-9 if key == "kv_moved_bytes" else 1e3 if key == "transfer_s_mean" else 1
            text = fmt(value, scale, pattern)
        table.add_row(label, text)
    console.print(table)
    rows = Table(title="replicas")
    for col in ("replica", "role", "requests", "out tok/s", "hit rate", "busy", "TTFT p50 s",
                "prefill tok", "decode tok"):
        rows.add_column(col, justify="left" if col in ("replica", "role") else "right")
    for r in result["replicas"]:
        rows.add_row(r["name"], r["role"], f"{r['requests']:,}",
                     f"{r['output_tokens_per_s']:,.0f}", f"{r['prefix_hit_rate']:.1%}",
                     f"{r['busy_share']:.0%}", fmt(r["ttft_p50_s"], 1, "{:.3f}"),
                     f"{r['prefill_tokens']:,}", f"{r['decode_tokens']:,}")
    console.print(rows)
    if result.get("stages"):
        stages = Table(title="load stages")
        for col in ("stage", "requests", "out tok/s", "TTFT p50 s", "TTFT p90 s"):
            stages.add_column(col, justify="right")
        for st in result["stages"]:
            stages.add_row(str(st["stage"]), f"{st['requests']:,}",
                           f"{st['output_tokens_per_s']:,.0f}", fmt(st["ttft_p50_s"], 1, "{:.3f}"),
                           fmt(st["ttft_p90_s"], 1, "{:.3f}"))
        console.print(stages)
