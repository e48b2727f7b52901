"""Rich rendering of `kvdeck models` output."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvdeck.runtime.models.registry import ModelEntry


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render_model_list(console: Console, entries: list[ModelEntry]) -> None:
    table = Table(title="Models kvdeck can run without a download")
    table.add_column("name", no_wrap=True)
    table.add_column("source", no_wrap=True)
    table.add_column("description")
    table.add_column("kind")
    table.add_column("status")
    for e in entries:
        status = "[green]ready[/]" if e.available else "[yellow]not installed[/]"
        if e.note:
            status += f" ({escape(e.note)})"
        table.add_row(escape(e.name), e.source, escape(e.description), e.kind or "—", status)
    console.print(table)


def render_model_report(console: Console, r: dict) -> None:
    arch = Table(title=escape(f"{r['name']} — {r['path']}"), show_header=False)
    arch.add_column("fact", style="bold")
    arch.add_column("value")
    window = "none (all layers global)"
    if r["sliding_window"]:
        layers = r["sliding_window_layers"]
        window = (f"{r['sliding_window']} tokens on {len(layers)} of {r['num_layers']} layers "
                  f"(global: {sorted(set(range(r['num_layers'])) - set(layers))})")
    rows = [
        ("architecture", r["architecture"]),
        ("kind", "instruct: the file has a chat template; it answers chats" if r["chat_template"]
         else "base: no chat template; it continues text (the console runs plain "
              "completions)"),
        ("layers", r["num_layers"]),
        ("hidden size / FFN", f"{r['hidden_size']} / {r['ffn_size']}"),
        ("attention heads", r["num_heads"]),
        ("KV heads", r["num_kv_heads"]),
        ("head dim", r["head_dim"]),
        ("sliding window", window),
        ("context length", f"{r['context_length']:,}"),
        ("vocab size", f"{r['vocab_size']:,}"),
        ("RoPE base", f"{r['rope_freq_base']:,.0f}"),
        ("weights", f"{human_bytes(r['weight_bytes'])} ({r['weight_bytes']:,} B)"),
        ("matrix weights per step (D_w)", f"{human_bytes(r['matrix_weight_bytes'])}"),
    ]
    for k, v in rows:
        arch.add_row(k, str(v))
    console.print(arch)

    types = Table(title="Tensor types")
    for col, just in (("type", "left"), ("tensors", "right"), ("bytes", "right")):
        types.add_column(col, justify=just)
    for t in r["tensor_types"]:
        types.add_row(t["type"], str(t["count"]), f"{human_bytes(t['bytes'])}")
    console.print(types)

    kv = Table(title=f"KV cache cost (block size {r['block_size']}: "
                     f"{r['blocks_per_1k_tokens']} blocks per 1K tokens)")
    for col in ("format", "bytes / token", "bytes / block", "full context"):
        kv.add_column(col, justify="right" if col != "format" else "left")
    for fmt, b in r["kv_bytes_per_token"].items():
        kv.add_row(fmt, f"{b:,}", human_bytes(r["kv_bytes_per_block"][fmt]),
                   human_bytes(r["kv_bytes_full_context"][fmt]))
    console.print(kv)
