"""`kvdeck bench`: an arrival trace against any OpenAI-compatible server.

Its thirty options are one frozen `BenchOptions` (`with_options` turns each field into a
flag, its `typer.Option` carrying the help); the command checks them, builds the arrivals
and runs them in-process or over HTTP."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from kvdeck.console.commands.common import err, fail, guarded, out, print_json
from kvdeck.console.options import SettingsRequest, with_options, with_settings
from kvdeck.runtime.core.config import check_float, check_int
from kvdeck.runtime.logs import setup_logging


@dataclass(frozen=True)
class BenchOptions:
    """What `kvdeck bench` sends, how, and what it reports."""

    trace: Annotated[str | None, typer.Argument(
        help="Arrival trace (JSONL/CSV) or a sample's name; omit for synthetic "
             "arrivals.")] = None
    url: Annotated[str, typer.Option("--url", help="OpenAI-compatible base URL.")] = \
        "http://127.0.0.1:8000/v1"
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Bearer key, if the server needs one.")] = None
    in_process: Annotated[bool, typer.Option(
        "--in-process", help="Run against an engine in this process, no HTTP (the engine "
                             "flags apply).")] = False
    limit: Annotated[int | None, typer.Option(
        "--limit", help="Send only the first N requests.")] = None
    time_scale: Annotated[float, typer.Option(
        "--time-scale", help="Multiply inter-arrival times.")] = 1.0
    rate: Annotated[float, typer.Option("--rate", help="Synthetic: requests per second.")] = 2.0
    burstiness: Annotated[float, typer.Option(
        "--burstiness", help="Synthetic: gamma shape (1 = Poisson, <1 bursty).")] = 1.0
    num_requests: Annotated[int, typer.Option(
        "--num-requests", help="Synthetic: how many.")] = 32
    prompt_len: Annotated[int, typer.Option(
        "--prompt-len", help="Synthetic: mean prompt tokens.")] = 256
    output_len: Annotated[int, typer.Option(
        "--output-len", help="Synthetic: mean output tokens.")] = 64
    length_spread: Annotated[float, typer.Option(
        "--length-spread", help="Synthetic: lengths uniform within ± this fraction of the "
                                "means (0: exact).")] = 0.5
    concurrency: Annotated[int | None, typer.Option(
        "--concurrency", help="At most N requests in flight (vLLM's --max-concurrency); a "
                              "request's clock starts at its scheduled arrival (waiting for "
                              "a place counts), the send time is kept beside it.")] = None
    text_prompts: Annotated[bool, typer.Option(
        "--text-prompts", help="Send prompts as text: windows of a built-in English "
                               "passage, --prompt-len tokens by --model's tokenizer (for "
                               "servers that take no token ids, e.g. "
                               "llama-cpp-python's).")] = False
    exact_length_field: Annotated[str, typer.Option(
        "--exact-length-field", help="How requests ask for exactly their output length: "
                                     "ignore_eos (kvdeck, vLLM, SGLang) or min_tokens "
                                     "(llama-cpp-python).")] = "ignore_eos"
    max_prompt_len: Annotated[int | None, typer.Option(
        "--max-prompt-len", help="Cap traced prompts.")] = None
    max_output_len: Annotated[int | None, typer.Option(
        "--max-output-len", help="Cap traced outputs.")] = None
    vocab_size: Annotated[int, typer.Option(
        "--vocab-size", help="Token ids for synthetic prompts stay below this.")] = 32_000
    hash_block_tokens: Annotated[int, typer.Option(
        "--hash-block-tokens", help="Tokens per Mooncake hash id.")] = 512
    warmup: Annotated[bool, typer.Option(
        "--warmup/--no-warmup", help="Send one uncounted request first, its prompt as long as "
        "the first arrival's (other tokens).")] = True
    retries: Annotated[int, typer.Option(
        "--retries", help="Send a request again, up to N times, while its answer fails its "
                          "check (a trace's \"check\") or it errors; reports the retries and "
                          "the time to a correct answer (from the scheduled arrival). Retries help "
                          "only where answers vary: see --temperature.")] = 0
    temperature: Annotated[float, typer.Option(
        "--temperature", help="Sampling temperature of every request; above 0, each send "
                              "carries its own seed, so a run is reproducible and a retry "
                              "draws a new answer.")] = 0.0
    send_checks: Annotated[bool, typer.Option(
        "--send-checks", help="Also send each trace check as kvdeck's \"check\" field, so a "
                              "kvdeck server counts it in its own goodput (/metrics).")] = False
    questions: Annotated[str | None, typer.Option(
        "--questions", help="Ask a checked question set (JSONL of {question, check}, or "
                            "'checked-questions', the shipped one) of each of --models in "
                            "turn and report accuracy and accelerator seconds per good "
                            "answer.")] = None
    models: Annotated[str | None, typer.Option(
        "--models", help="With --questions: the served model names to compare, comma-"
                         "separated, e.g. qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,cascade.")] \
        = None
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print summary and every request.")] = False
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="Also write the JSON here.")] = None
    slo_ttft: Annotated[float | None, typer.Option(
        "--slo-ttft", help="TTFT SLO in seconds.")] = None
    slo_tpot: Annotated[float | None, typer.Option(
        "--slo-tpot", help="TPOT SLO in seconds.")] = None
    slo_e2e: Annotated[float | None, typer.Option(
        "--slo-e2e", help="E2E SLO in seconds.")] = None

    @property
    def shapes_http(self) -> bool:
        """Whether an option that only shapes HTTP requests is set."""
        return bool(self.concurrency or self.text_prompts or self.retries or self.temperature
                    or self.exact_length_field != "ignore_eos" or self.send_checks)


@with_settings
@with_options(BenchOptions)
def bench(opts: BenchOptions, settings: SettingsRequest = SettingsRequest(),
          log_level: str = "warning") -> None:
    """Send a trace (or synthetic Poisson/gamma load) to a server and report TTFT, TPOT, ITL,
    E2E, throughput and goodput with vLLM's serving-benchmark definitions; requests that
    carry a check count as good only when their answer passes it. --model names the model
    the server serves (default gemma3-270m)."""
    from kvdeck.console.run_views import render_summary
    from kvdeck.runtime.stats.metrics import SLO

    guarded(lambda: setup_logging(log_level))
    if opts.questions or opts.models:
        from kvdeck.console.commands.bench_models import bench_models

        bench_models(opts)
        return
    _check(opts)
    items = guarded(lambda: _arrivals(opts))
    slo = guarded(lambda: SLO(opts.slo_ttft, opts.slo_tpot, opts.slo_e2e))
    result = _in_process(opts, items, slo, settings) if opts.in_process else \
        _over_http(opts, items, slo, settings)
    if opts.output:
        Path(opts.output).write_text(json.dumps(result, indent=1))
    if opts.as_json:
        print_json(result)
    else:
        render_summary(out, f"kvdeck bench → {'in-process' if opts.in_process else opts.url}",
                       result["summary"])


def _check(opts: BenchOptions) -> None:
    """One sentence and exit 2 for an option out of its range or one that does not apply."""
    from kvdeck.runtime.runs.loadgen import EXACT_LENGTH_FIELDS, MAX_RETRIES

    if opts.concurrency is not None:
        guarded(lambda: check_int("--concurrency", opts.concurrency, 1, 1 << 16))
    guarded(lambda: check_int("--retries", opts.retries, 0, MAX_RETRIES))
    guarded(lambda: check_float("--temperature", opts.temperature, 0.0, 2.0))
    if opts.exact_length_field not in EXACT_LENGTH_FIELDS:
        fail(f"--exact-length-field must be one of {', '.join(EXACT_LENGTH_FIELDS)}, got "
             f"{opts.exact_length_field!r}.")
    if opts.in_process and opts.shapes_http:
        fail("--concurrency, --text-prompts, --exact-length-field, --retries, --temperature "
             "and --send-checks shape HTTP requests; with --in-process, cap running requests "
             "with --max-num-seqs.")


def _arrivals(opts: BenchOptions) -> list:
    """The trace's arrivals (capped), or synthetic ones."""
    from kvdeck.runtime.runs.loadgen import cap_arrivals
    from kvdeck.runtime.runs.trace import load_arrivals, synthetic_arrivals

    if opts.trace is None:
        return synthetic_arrivals(opts.num_requests, opts.rate, burstiness=opts.burstiness,
                                  prompt_len=opts.prompt_len, output_len=opts.output_len,
                                  spread=opts.length_spread)
    got = load_arrivals(opts.trace, limit=opts.limit, time_scale=opts.time_scale)
    return cap_arrivals(got, opts.max_prompt_len, opts.max_output_len, opts.hash_block_tokens)


def _in_process(opts: BenchOptions, items: list, slo, settings: SettingsRequest) -> dict:
    """The arrivals through an engine in this process (the engine flags apply)."""
    from kvdeck.runtime.runs.runner import needs_tokenizer, run_arrivals
    from kvdeck.runtime.session import build_session

    def local() -> dict:
        session = build_session(settings.resolve("torch"), with_tokenizer=needs_tokenizer(items))
        try:
            return run_arrivals(session.engine, items,
                                vocab_size=min(opts.vocab_size, session.vocab_size), slo=slo,
                                hash_block_tokens=opts.hash_block_tokens)
        finally:
            session.close()

    return guarded(local)


def _over_http(opts: BenchOptions, items: list, slo, settings: SettingsRequest) -> dict:
    """The arrivals sent to `opts.url`, with a progress bar on stderr."""
    import asyncio

    from rich.progress import Progress

    from kvdeck.runtime.runs.loadgen import RequestShape, run_bench

    model = (settings.flags or {}).get("model", "gemma3-270m")

    def shape() -> RequestShape:
        text = None
        if opts.text_prompts:
            from kvdeck.runtime.models.registry import resolve_model
            from kvdeck.runtime.runs.loadgen import passage_prompts
            from kvdeck.runtime.text.tokenizer import Tokenizer

            text = passage_prompts(Tokenizer(resolve_model(model)))
        return RequestShape(opts.vocab_size, opts.hash_block_tokens, text,
                            opts.exact_length_field, opts.temperature, opts.send_checks)

    request_shape = guarded(shape)
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task(f"{len(items)} requests → {opts.url}", total=len(items))
        return asyncio.run(run_bench(opts.url, model, items, shape=request_shape,
                                     api_key=opts.api_key, slo=slo,
                                     concurrency=opts.concurrency, warmup=opts.warmup,
                                     retries=opts.retries,
                                     on_done=lambda _: progress.advance(task)))
