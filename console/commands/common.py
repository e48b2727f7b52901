"""What every command shares: the output consoles, one-line user errors, JSON output and
the start-up settings line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from kvdeck.console.model_report import human_bytes
from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.views.snapshot import snapshot_of

out = Console()


err = Console(stderr=True)


def fail(message: str) -> None:
    """Print a user error as one line on stderr and exit with code 2."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except KvdeckError as e:
        fail(str(e))


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def settings_line(session) -> str:
    """The settings a command runs with, in one line (printed at start-up)."""
    snap = snapshot_of(session.engine)
    k = snap.knobs
    slots = session.executor.info.slots
    # llama.cpp splits the pool evenly over its slots: say where a longer context comes from.
    per_slot = f" (the pool over {slots} slots; fewer --n-parallel or more --kv-memory-gib " \
        "for longer)" if slots else ""
    return (f"{snap.model_name} on {snap.executor}: {snap.kv.num_blocks:,} KV blocks of "
            f"{snap.kv.block_size} tokens ({snap.kv.kv_format}), context "
            f"{session.engine.max_model_len:,}{per_slot}, "
            f"max_num_seqs {k.max_num_seqs}, max_num_batched_tokens "
            f"{k.max_num_batched_tokens}, chunk_size {k.chunk_size}, prefix caching "
            f"{'on' if k.enable_prefix_caching else 'off'}, weights {k.weight_format}"
            + weights_lines(snap) + transfers_line(snap) + speculation_line(snap)
            + (f"\n  executor: {session.settings.executor_choice}"
               if session.settings.executor_choice else ""))


def speculation_line(snap) -> str:
    """Speculative decoding and the draft model, when either is configured."""
    v, k = snap.speculation, snap.knobs
    if v is None or (k.speculative_method == "off" and not v.draft_model):
        return ""
    text = f"speculation {k.speculative_method}"
    if k.speculative_method != "off":
        text += f", k = {k.num_speculative_tokens} ({k.draft_length})"
    if v.draft_model:
        kv = snap.kv
        text += (f", draft model {v.draft_model} (twin KV {human_bytes(kv.draft_bytes_per_block)}"
                 f" per block beside {human_bytes(kv.bytes_per_block)})")
    return f"\n  {text}"


def transfers_line(snap) -> str:
    """The host tier, preemption mode and weight offload, when any is configured."""
    t, k = snap.transfers, snap.knobs
    parts = []
    if t is not None and t.host_blocks:
        parts.append(f"host KV tier {t.host_blocks:,} blocks, preemption {k.preemption}, "
                     f"prefix demotion {'on' if k.demote_prefixes else 'off'}")
    if t is not None and t.offload:
        parts.append(f"offload {t.offload.replace('; ', ', ')}")
    if t is not None and parts:
        parts.append(f"link {t.link_detail}")
    return "".join(f"\n  {p}" for p in parts)


def weights_lines(snap) -> str:
    """The weights' bytes and, when the start-up micro-benchmark ran, its figures."""
    w = snap.weights
    if w is None:
        return ""
    text = f" ({human_bytes(w.resident_bytes)}{'; ' + w.detail if w.detail else ''})"
    for line in w.kernels:
        text += f"\n  measured {line}"
    return text


def config_report(session) -> dict:
    """The resolved settings and the engine's config, as JSON (run-trace --json, and
    `GET /kvdeck/config` on a server)."""
    from kvdeck.runtime.server.app import config_json

    return config_json(session.settings, session.engine)
