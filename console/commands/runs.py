"""`kvdeck run-trace`, `kvdeck replay` and `kvdeck compare`: runs driven, replayed and
compared."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvdeck.console.commands.common import config_report, fail, guarded, out, print_json
from kvdeck.console.options import SettingsRequest, with_log_level, with_settings
from kvdeck.runtime.core.config import check_int
from kvdeck.runtime.errors import ConfigError, KvdeckError
from kvdeck.runtime.logs import setup_logging


@with_settings
def run_trace(
    trace: str = typer.Argument(..., help="Arrival trace: a kvdeck/Mooncake JSONL or Azure CSV "
                                "file, or a sample's name (azure-conv, azure-code, "
                                "mooncake-conversation)."),
    record: str = typer.Option(None, "--record", help="Write a run directory here."),
    as_json: bool = typer.Option(False, "--json", help="Print summary and every request."),
    output: str = typer.Option(None, "--output", "-o", help="Also write the JSON here."),
    fmt: str = typer.Option("auto", "--format", help="auto, kvdeck, mooncake, azure, bailian, "
                            "burstgpt, aiperf, stages, or timed-trace[:chunk_hash_size=16,"
                            "sec_multiplier=1,label_timestamp=timestamp,…] (vLLM's)."),
    limit: int = typer.Option(None, "--limit", help="Run only the first N requests."),
    time_scale: float = typer.Option(1.0, "--time-scale",
                                     help="Multiply inter-arrival times (0.5 = twice the rate)."),
    hash_block_tokens: int = typer.Option(512, "--hash-block-tokens",
                                          help="Tokens per Mooncake hash id."),
    before: str = typer.Option(None, "--before", help="A trace (file or sample) whose "
                               "requests are served first, one after another, and not "
                               "counted: what the server being predicted served before the "
                               "trace (a start-up check, say)."),
    warmup: bool = typer.Option(False, "--warmup", help="Serve kvdeck bench's uncounted "
                                "warm-up first (after --before's): a prompt as long as the "
                                "first request's, two outputs."),
    slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT SLO in seconds."),
    slo_tpot: float = typer.Option(None, "--slo-tpot", help="TPOT SLO in seconds."),
    slo_e2e: float = typer.Option(None, "--slo-e2e", help="E2E SLO in seconds."),
    replicas: int = typer.Option(1, "--replicas", help="Simulated replicas on one clock "
                                 "behind --router (sim executor).", rich_help_panel="Fleet"),
    router: str = typer.Option("round-robin", "--router", help="round-robin, random, "
                               "least-loaded, prefix, weighted[:prefix=3,kv=2,queue=2] or "
                               "cost[:overlap=1,temperature=0].", rich_help_panel="Fleet"),
    router_staleness: float = typer.Option(0.0, "--router-staleness", help="Seconds after a "
                                           "step its KV events and metrics reach the router.",
                                           rich_help_panel="Fleet"),
    session_affinity: bool = typer.Option(True, "--session-affinity/--no-session-affinity",
                                          help="Later turns of a session go where its first "
                                               "went.", rich_help_panel="Fleet"),
    prefill_replicas: int = typer.Option(0, "--prefill-replicas", help="Disaggregated: "
                                         "replicas that only prefill.",
                                         rich_help_panel="Fleet"),
    decode_replicas: int = typer.Option(0, "--decode-replicas", help="Disaggregated: "
                                        "replicas that only decode.", rich_help_panel="Fleet"),
    kv_link: float = typer.Option(None, "--kv-link-bandwidth", help="Disaggregated: the "
                                  "prefill-to-decode link in GB/s (gigabytes; default: the "
                                  "hardware profile's link).", rich_help_panel="Fleet"),
    kv_transfer: str = typer.Option("layerwise", "--kv-transfer", help="Disaggregated: "
                                    "layerwise (overlapped with the prefill) or after.",
                                    rich_help_panel="Fleet"),
    decode_router: str = typer.Option("least-loaded", "--decode-router",
                                      help="Disaggregated: the router that picks the decode "
                                           "replica (as --router).", rich_help_panel="Fleet"),
    settings: SettingsRequest = SettingsRequest(), log_level: str = "warning",
) -> None:
    """Run an arrival trace through the engine headless (sim executor by default) and
    summarize it; with --replicas N or --prefill-replicas/--decode-replicas, through a
    simulated fleet behind a router.

    Long because its options are its signature (typer reads them there)."""
    from kvdeck.console.run_views import render_summary
    from kvdeck.runtime.runs.loadgen import warmup as warmup_request
    from kvdeck.runtime.runs.recording import record_headless
    from kvdeck.runtime.runs.runner import needs_tokenizer, run_arrivals
    from kvdeck.runtime.runs.trace import load_arrivals
    from kvdeck.runtime.session import build_session
    from kvdeck.runtime.stats.metrics import SLO

    fleet = replicas != 1 or prefill_replicas or decode_replicas

    def go() -> dict:
        setup_logging(log_level)
        check_int("--hash-block-tokens", hash_block_tokens, 1, 1 << 20)
        if fleet:
            if before or warmup:
                raise ConfigError("--before and --warmup run on one engine; leave them out "
                                  "with --replicas, --prefill-replicas or --decode-replicas.")
            return run_fleet_trace()
        if limit is not None:
            check_int("--limit", limit, 1, 1 << 30)
        resolved = settings.resolve("sim")
        slo = SLO(slo_ttft, slo_tpot, slo_e2e)
        arrivals = load_arrivals(trace, fmt, limit=limit, time_scale=time_scale)
        first = [*(load_arrivals(before) if before else ()),
                 *((warmup_request(arrivals),) if warmup else ())]
        session = build_session(resolved, with_tokenizer=needs_tokenizer(arrivals))
        engine = session.engine
        recorder = record_headless(engine, record) if record else None
        try:
            result = run_arrivals(engine, arrivals, vocab_size=session.vocab_size,
                                  hash_block_tokens=hash_block_tokens, slo=slo,
                                  on_arrival=recorder.arrival if recorder else None,
                                  before=first)
        except KvdeckError:
            raise
        except Exception as e:  # noqa: BLE001 - an engine failure: one sentence and a log
            raise engine.fail(e).error("The run") from None
        finally:
            if recorder:
                recorder.close()
            session.close()
        result["trace"] = str(trace)
        result["config"] = config_report(session)
        return result

    def run_fleet_trace() -> dict:
        from kvdeck.runtime.cluster.replicas import ClusterConfig, replica_roles
        from kvdeck.runtime.cluster.run import run_fleet

        if record:
            raise ConfigError("--record records one engine; a fleet run is not recorded.")
        roles = replica_roles(replicas, prefill_replicas, decode_replicas)
        config = ClusterConfig(router=router, decode_router=decode_router,
                               staleness_s=router_staleness,
                               session_affinity=session_affinity, kv_transfer=kv_transfer,
                               kv_link_bytes_per_s=kv_link * 1e9 if kv_link is not None
                               else None)
        arrivals = load_arrivals(trace, fmt, limit=limit, time_scale=time_scale)
        result = run_fleet(settings.resolve("sim"), roles, config, arrivals,
                           slo=SLO(slo_ttft, slo_tpot, slo_e2e),
                           hash_block_tokens=hash_block_tokens)
        result["trace"] = str(trace)
        return result

    result = guarded(go)
    if output:
        Path(output).write_text(json.dumps(result, indent=1))
    if as_json:
        print_json(result)
    elif fleet:
        from kvdeck.console.fleet_report import render_fleet

        render_fleet(out, f"{trace} on {result['summary']['model']}", result)
    else:
        render_summary(out, f"{trace} on {result['summary']['model']}", result["summary"])
        if result["summary"]["statuses"].get("rejected"):
            out.print("some requests were rejected; --json lists each one's reason")
        if record:
            out.print(f"run recorded in {record}")


@with_log_level
def replay(run: str = typer.Argument(..., help="A run directory written by recording."),
           summary: bool = typer.Option(False, "--summary",
                                        help="Print the run's figures (as run-trace does) "
                                             "instead of opening the console."),
           as_json: bool = typer.Option(False, "--json", help="With --summary: as JSON."),
           slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT SLO in seconds."),
           slo_tpot: float = typer.Option(None, "--slo-tpot", help="TPOT SLO in seconds."),
           slo_e2e: float = typer.Option(None, "--slo-e2e", help="E2E SLO in seconds."),
           log_level: str = "warning") -> None:
    """Open a recorded run in the console's panels, with play/pause, speed and a scrubber;
    or, with --summary, print its figures computed from the records alone."""
    guarded(lambda: setup_logging(log_level, to_stderr=False))
    if summary:
        from kvdeck.console.run_views import render_summary
        from kvdeck.runtime.runs.replay import summarize_run
        from kvdeck.runtime.stats.metrics import SLO

        result = guarded(lambda: summarize_run(run, SLO(slo_ttft, slo_tpot, slo_e2e)))
        if as_json:
            print_json(result)
        else:
            render_summary(out, f"replay of {run} on {result['model']}", result)
            if result["unfinished"]:
                out.print(f"{result['unfinished']} requests had not finished when the "
                          "recording stopped; the figures cover the finished ones")
        return
    from kvdeck.console.screens.replay import ReplayApp

    app = guarded(lambda: ReplayApp(run))
    app.run()
    if app.problem is not None:  # a record the replay could not apply
        fail(app.problem)


@with_log_level
def compare(
    a: str = typer.Argument(..., help="Result JSON of run-trace --json (A)."),
    b: str = typer.Argument(..., help="Result JSON of run-trace --json (B)."),
    log_level: str = "warning",
) -> None:
    """Print two run-trace results side by side with deltas."""
    from kvdeck.console.run_views import render_compare

    def load(path: str) -> dict:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"Result file {p} does not exist.") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"Result file {p} is not valid JSON ({e.msg}).") from None
        if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
            raise ConfigError(f"Result file {p} has no 'summary'; write it with "
                              "kvdeck run-trace --json or --output.")
        return data["summary"]

    guarded(lambda: setup_logging(log_level))
    sa, sb = guarded(lambda: load(a)), guarded(lambda: load(b))
    render_compare(out, a, sa, b, sb)
