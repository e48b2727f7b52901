"""`kvdeck quality`: what weight and KV formats cost in accuracy."""

from __future__ import annotations

import typer

from kvdeck.console.commands.common import guarded, out, print_json
from kvdeck.console.options import with_log_level
from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.logs import setup_logging


@with_log_level
def quality(
    model: str = typer.Argument(None, help="Model name or GGUF path (default: the embedded "
                                "model)."),
    weights: str = typer.Option(None, "--weights", help="Weight formats to measure, "
                                "comma-separated (default bf16,int8,int4; none with "
                                "--kv-eviction alone)."),
    kv: str = typer.Option(None, "--kv", help="KV formats to measure, comma-separated "
                           "(default fp16,bf16,fp8_e4m3,q8_0,q4_0; none with --kv-eviction "
                           "alone)."),
    kv_eviction: str = typer.Option("", "--kv-eviction", help="Token-level KV eviction "
                                    "modes to measure: sink-window, heavy-hitter."),
    sink: int = typer.Option(4, "--kv-sink-tokens", help="Eviction: sink tokens kept."),
    recent: int = typer.Option(128, "--kv-recent-tokens", help="Eviction: recent tokens kept."),
    heavy: int = typer.Option(64, "--kv-heavy-tokens",
                              help="Heavy-hitter eviction: most-attended tokens kept besides."),
    pool_blocks: int = typer.Option(24, "--pool-blocks", help="Eviction: the pool, in blocks "
                                    "of 16 tokens (fewer than the passage takes)."),
    chunk_size: int = typer.Option(32, "--chunk-size",
                                   help="Eviction: prompt tokens computed per step."),
    threads: int = typer.Option(None, "--threads", help="CPU threads."),
    int8_group_size: int = typer.Option(64, "--int8-group-size",
                                        help="Inputs per int8 scale (0: per channel)."),
    int4_group_size: int = typer.Option(32, "--int4-group-size",
                                        help="Inputs per int4 scale and zero."),
    weight_activations: str = typer.Option("measured", "--weight-activations",
                                           help="measured, fp32, bf16 or fp16."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
    log_level: str = "warning",
) -> None:
    """Measure what weight and KV formats cost in accuracy against fp32 weights with fp32 KV
    (teacher-forced top-1 agreement and mean |Δlogit| over a fixed text, identical greedy
    tokens on three prompts), on the CPU. Figures are cached per model and format; the
    console shows them beside the weight_format and kv_format knobs. With --kv-eviction,
    what token-level eviction costs on the same text served through the engine in a pool
    smaller than it (top-1 agreement, mean |Δlogit|, perplexity against full KV)."""
    from dataclasses import asdict

    from kvdeck.runtime.text.eviction_quality import measure_eviction
    from kvdeck.runtime.text.quality import measure_formats
    from kvdeck.runtime.text.tokenizer import Tokenizer

    def build():
        setup_logging(log_level)
        from kvdeck.runtime.executors.torch import TorchExecutor
        from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

        w, k = _formats(weights, kv, alone=bool(kv_eviction) and weights is None and kv is None)
        policies = _policies(kv_eviction, sink, recent, heavy)
        path = resolve_model(model or DEFAULT_MODEL)
        ex = TorchExecutor(path, device="cpu", dtype="fp32", threads=threads,
                           int8_group_size=int8_group_size, int4_group_size=int4_group_size,
                           weight_activations=weight_activations)
        return ex, Tokenizer(path), w, k, policies

    ex, tok, w, k, policies = guarded(build)
    if not as_json:
        out.print(f"measuring {ex.info.model_name} against fp32 weights + fp32 KV (cached figures "
                  "are reused)…", highlight=False)
    results = guarded(lambda: measure_formats(ex, tok, w, k))
    evictions = guarded(lambda: measure_eviction(ex, tok, policies, pool_blocks, chunk_size)
                        if policies else [])
    ex.close()
    if as_json:
        print_json([asdict(q) for q in results + evictions])
        return
    for q in evictions:
        out.print(q.line(), highlight=False)
    for q in results:
        where = ", ".join(f"{p} ({m:.3f})" for p, m in q.disagreements[:3])
        out.print(q.line() + (f"; first disagreements at position (reference margin): "
                              f"{where}" if where else ""), highlight=False)


def _formats(weights: str | None, kv: str | None, alone: bool
             ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The weight and KV formats to measure (none of either when `alone`: only eviction
    was asked for)."""
    from kvdeck.runtime.kv.formats import KV_FORMATS
    from kvdeck.runtime.models.weight_formats import FORMATS

    w = tuple(x for x in ("" if alone else weights or "bf16,int8,int4").split(",") if x)
    k = tuple(x for x in ("" if alone else kv or "fp16,bf16,fp8_e4m3,q8_0,q4_0").split(",")
              if x)
    measurable = [f for f in FORMATS if f not in ("auto", "dense")]
    for x in w:
        if x not in measurable:
            raise KvdeckError(f"--weights names {x!r}; measurable weight formats are "
                              f"{', '.join(measurable)}.")
    for x in k:
        if x not in KV_FORMATS:
            raise KvdeckError(f"--kv names {x!r}; KV formats are {', '.join(KV_FORMATS)}.")
    return w, k


def _policies(modes: str, sink: int, recent: int, heavy: int) -> list:
    """`--kv-eviction`'s policies, labelled; sink-window is measured without its sinks
    too, to show what they hold up."""
    from kvdeck.runtime.kv.eviction import EVICTION_MODES, Eviction

    policies = []
    for mode in (m for m in modes.split(",") if m):
        if mode not in EVICTION_MODES[1:]:
            raise KvdeckError(f"--kv-eviction names {mode!r}; modes are "
                              f"{', '.join(EVICTION_MODES[1:])}.")
        policy = Eviction(mode, sink, recent, heavy)
        policy.check(16)
        policies.append((policy.describe(), policy))
        if mode == "sink-window" and sink:
            policies.append(("window alone (no sink)", Eviction(mode, 0, recent, heavy)))
    return policies
