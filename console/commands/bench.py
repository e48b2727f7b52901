"""`kvdeck bench`: an arrival trace against any OpenAI-compatible server."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvdeck.console.commands.common import err, fail, guarded, out, print_json
from kvdeck.console.options import SettingsRequest, with_settings
from kvdeck.runtime.core.config import check_float, check_int
from kvdeck.runtime.logs import setup_logging


@with_settings
def bench(
    trace: str = typer.Argument(None, help="Arrival trace (JSONL/CSV) or a sample's name; "
                                "omit for synthetic arrivals."),
    url: str = typer.Option("http://127.0.0.1:8000/v1", "--url",
                            help="OpenAI-compatible base URL."),
    api_key: str = typer.Option(None, "--api-key", help="Bearer key, if the server needs one."),
    in_process: bool = typer.Option(False, "--in-process",
                                    help="Run against an engine in this process, no HTTP "
                                         "(the engine flags apply)."),
    limit: int = typer.Option(None, "--limit", help="Send only the first N requests."),
    time_scale: float = typer.Option(1.0, "--time-scale", help="Multiply inter-arrival times."),
    rate: float = typer.Option(2.0, "--rate", help="Synthetic: requests per second."),
    burstiness: float = typer.Option(1.0, "--burstiness",
                                     help="Synthetic: gamma shape (1 = Poisson, <1 bursty)."),
    num_requests: int = typer.Option(32, "--num-requests", help="Synthetic: how many."),
    prompt_len: int = typer.Option(256, "--prompt-len", help="Synthetic: mean prompt tokens."),
    output_len: int = typer.Option(64, "--output-len", help="Synthetic: mean output tokens."),
    length_spread: float = typer.Option(0.5, "--length-spread",
                                        help="Synthetic: lengths uniform within ± this "
                                             "fraction of the means (0: exact)."),
    concurrency: int = typer.Option(None, "--concurrency",
                                    help="At most N requests in flight (vLLM's "
                                         "--max-concurrency); a request's clock starts when "
                                         "it is sent."),
    text_prompts: bool = typer.Option(False, "--text-prompts",
                                      help="Send prompts as text: windows of a built-in "
                                           "English passage, --prompt-len tokens by --model's "
                                           "tokenizer (for servers that take no token ids, "
                                           "e.g. llama-cpp-python's)."),
    exact_length_field: str = typer.Option("ignore_eos", "--exact-length-field",
                                           help="How requests ask for exactly their output "
                                                "length: ignore_eos (kvdeck, vLLM, SGLang) "
                                                "or min_tokens (llama-cpp-python)."),
    max_prompt_len: int = typer.Option(None, "--max-prompt-len", help="Cap traced prompts."),
    max_output_len: int = typer.Option(None, "--max-output-len", help="Cap traced outputs."),
    vocab_size: int = typer.Option(32_000, "--vocab-size",
                                   help="Token ids for synthetic prompts stay below this."),
    hash_block_tokens: int = typer.Option(512, "--hash-block-tokens",
                                          help="Tokens per Mooncake hash id."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup",
                                help="Send one uncounted short request first."),
    retries: int = typer.Option(0, "--retries",
                                help="Send a request again, up to N times, while its answer "
                                     "fails its check (a trace's \"check\") or it errors; "
                                     "reports the retries and the time to a correct answer "
                                     "(from the first send). Retries help only where answers "
                                     "vary: see --temperature."),
    temperature: float = typer.Option(0.0, "--temperature",
                                      help="Sampling temperature of every request; above 0, "
                                           "each send carries its own seed, so a run is "
                                           "reproducible and a retry draws a new answer."),
    send_checks: bool = typer.Option(False, "--send-checks",
                                     help="Also send each trace check as kvdeck's \"check\" "
                                          "field, so a kvdeck server counts it in its own "
                                          "goodput (/metrics)."),
    as_json: bool = typer.Option(False, "--json", help="Print summary and every request."),
    output: str = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
    slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT SLO in seconds."),
    slo_tpot: float = typer.Option(None, "--slo-tpot", help="TPOT SLO in seconds."),
    slo_e2e: float = typer.Option(None, "--slo-e2e", help="E2E SLO in seconds."),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Send a trace (or synthetic Poisson/gamma load) to a server and report TTFT, TPOT, ITL,
    E2E, throughput and goodput with vLLM's serving-benchmark definitions; requests that
    carry a check count as good only when their answer passes it. --model names the model
    the server serves (default gemma3-270m)."""
    import asyncio

    from rich.progress import Progress

    from kvdeck.console.run_views import render_summary
    from kvdeck.runtime.runs.loadgen import (
        EXACT_LENGTH_FIELDS,
        MAX_RETRIES,
        RequestShape,
        cap_arrivals,
        run_bench,
    )
    from kvdeck.runtime.runs.trace import load_arrivals, synthetic_arrivals
    from kvdeck.runtime.views.metrics import SLO

    def arrivals():
        setup_logging(log_level)
        if trace is None:
            return synthetic_arrivals(num_requests, rate, burstiness=burstiness,
                                      prompt_len=prompt_len, output_len=output_len,
                                      spread=length_spread)
        got = load_arrivals(trace, limit=limit, time_scale=time_scale)
        return cap_arrivals(got, max_prompt_len, max_output_len, hash_block_tokens)

    items = guarded(arrivals)
    slo = guarded(lambda: SLO(slo_ttft, slo_tpot, slo_e2e))
    if concurrency is not None:
        guarded(lambda: check_int("--concurrency", concurrency, 1, 1 << 16))
    guarded(lambda: check_int("--retries", retries, 0, MAX_RETRIES))
    guarded(lambda: check_float("--temperature", temperature, 0.0, 2.0))
    if exact_length_field not in EXACT_LENGTH_FIELDS:
        fail(f"--exact-length-field must be one of {', '.join(EXACT_LENGTH_FIELDS)}, got "
             f"{exact_length_field!r}.")
    if in_process and (concurrency or text_prompts or exact_length_field != "ignore_eos"
                       or retries or temperature or send_checks):
        fail("--concurrency, --text-prompts, --exact-length-field, --retries, --temperature "
             "and --send-checks shape HTTP requests; with --in-process, cap running requests "
             "with --max-num-seqs.")
    if in_process:
        from kvdeck.runtime.runs.runner import needs_tokenizer, run_arrivals
        from kvdeck.runtime.session import build_session

        def local() -> dict:
            session = build_session(settings.resolve("torch"),
                                    with_tokenizer=needs_tokenizer(items))
            try:
                return run_arrivals(session.engine, items,
                                    vocab_size=min(vocab_size, session.vocab_size), slo=slo,
                                    hash_block_tokens=hash_block_tokens)
            finally:
                session.close()

        result = guarded(local)
    else:
        model = (settings.flags or {}).get("model", "gemma3-270m")

        def shape() -> RequestShape:
            text = None
            if text_prompts:
                from kvdeck.runtime.models.registry import resolve_model
                from kvdeck.runtime.runs.loadgen import passage_prompts
                from kvdeck.runtime.text.tokenizer import Tokenizer

                text = passage_prompts(Tokenizer(resolve_model(model)))
            return RequestShape(vocab_size, hash_block_tokens, text, exact_length_field,
                                temperature, send_checks)

        request_shape = guarded(shape)
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task(f"{len(items)} requests → {url}", total=len(items))
            result = asyncio.run(run_bench(url, model, items, shape=request_shape,
                                           api_key=api_key, slo=slo, concurrency=concurrency,
                                           warmup=warmup, retries=retries,
                                           on_done=lambda _: progress.advance(task)))
    if output:
        Path(output).write_text(json.dumps(result, indent=1))
    if as_json:
        print_json(result)
    else:
        render_summary(out, f"kvdeck bench → {'in-process' if in_process else url}",
                       result["summary"])
