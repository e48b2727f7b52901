"""`kvdeck calibrate`: measure a real executor and fit the sim's step-time model."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdeck.console.commands.common import guarded, out, print_json
from kvdeck.console.options import with_log_level
from kvdeck.runtime.logs import setup_logging


@with_log_level
def calibrate(
    model: str = typer.Argument(..., help="Model name or GGUF path (with --url: the model "
                                "the server serves)."),
    url: str = typer.Option(None, "--url", help="Fit a live OpenAI-compatible server "
                            "(its base URL) from outside instead, by probing it with "
                            "requests and reading its token timings (and what a prompt "
                            "after 2 to 20 idle seconds costs more: the sim adds it). "
                            "Behind llama-server, several decoding requests go to "
                            "neighbouring slots (id_slot), one pass each, and what saving "
                            "an idle slot to its prompt cache takes is timed (the sim's "
                            "--server-slots holds a launch for it)."),
    api_key: str = typer.Option(None, "--api-key", help="--url: bearer key, if needed."),
    model_profile: str = typer.Option(None, "--model-profile", help="--url: the model's "
                                      "shape (a profile, model name or GGUF; default the "
                                      "model)."),
    like: str = typer.Option("local", "--like", help="--url: the hardware profile whose "
                             "memory and peaks the server's card has (a client cannot "
                             "measure them; local: this machine, measured)."),
    hardware: str = typer.Option(None, "--hardware", help="--url: the hardware profile to "
                                 "write (default server-<host>-<port>)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option(None, "--dtype", help="Compute dtype (default per device)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads."),
    quick: bool = typer.Option(False, "--quick", help="A small sweep (seconds, not minutes)."),
    name: str = typer.Option(None, "--name", help="Profile name (default: the model name)."),
    as_json: bool = typer.Option(False, "--json", help="Print points and fit as JSON."),
    log_level: str = "warning",
) -> None:
    """Time a sweep of steps on a real model (or, with --url, probe a live server), fit the
    sim executor's step model, save it as profiles run-trace and plan use."""
    if url is not None:
        _from_server(url, model, api_key, model_profile, like, hardware, name, quick, as_json)
        return
    from kvdeck.runtime.executors.link import measure_link
    from kvdeck.runtime.planning.calibrate import (
        fit_step_model,
        hardware_name,
        sweep,
        write_profiles,
    )
    from kvdeck.runtime.planning.machine import measure_machine
    from kvdeck.runtime.planning.profiles import HardwareProfile
    from kvdeck.runtime.session import build_executor
    from kvdeck.runtime.settings import resolve

    def build():
        setup_logging(log_level)
        return build_executor(resolve({"executor": "torch", "model": model, "device": device,
                                       "dtype": dtype, "threads": threads}))

    ex = guarded(build)
    say = (lambda msg: None) if as_json else out.print
    say(f"calibrating {ex.info.model_name} on {ex.device} ({ex.dtype_name})")
    points = sweep(ex, quick=quick, progress=say)
    fit = fit_step_model(points)
    bandwidth, flops = measure_machine(str(ex.device))
    link = measure_link(ex.device).bandwidth
    profile = name or Path(str(ex.info.model_path)).stem
    hw = hardware_name(ex)
    model_file, hw_file = write_profiles(ex, fit, profile, hw, bandwidth, flops, points, link)
    measured = HardwareProfile.load(hw)
    rows = _rows(points, fit)
    if as_json:
        print_json({"fit": fit.to_json(), "points": rows,
                    "model_profile": str(model_file), "hardware_profile": str(hw_file),
                    "mfu": measured.mfu, "mbu": measured.mbu,
                    "bandwidth_bytes_per_s": bandwidth, "peak_flops": flops,
                    "link_bytes_per_s": link})
        return
    _table(rows, fit)
    out.print(f"peaks measured here: {bandwidth / 1e9:.1f} GB/s read, {flops / 1e9:.1f} GFLOP/s "
              f"matmul, link {link / 1e9:.1f} GB/s; this model reached MFU {measured.mfu:.3f} "
              f"and MBU {measured.mbu:.3f}", highlight=False)
    out.print(f"wrote {model_file} and {hw_file}; use them with the sim executor: "
              f'model_profile = "{profile}", hardware = "{hw}"')


def _rows(points, fit) -> list[dict]:
    from kvdeck.runtime.planning.calibrate import point_seconds

    rows = [{"point": p.label, "measured_ms": p.seconds * 1e3,
             "fit_ms": point_seconds(fit, p) * 1e3} for p in points if p.step]
    for r in rows:
        r["error_pct"] = 100 * (r["fit_ms"] - r["measured_ms"]) / r["measured_ms"]
    return rows


def _table(rows: list[dict], fit) -> None:
    from rich.table import Table

    table = Table(title=f"step = {fit.fixed_s * 1e3:.3f} ms + {fit.per_token_s * 1e6:.2f} µs × "
                        f"tokens + {fit.per_pair_s * 1e9:.4f} ns × pairs + "
                        f"{fit.per_sample_s * 1e6:.2f} µs × sampled rows + "
                        f"{fit.per_context_s * 1e9:.2f} ns × positions read"
                        + (f" + {fit.mixed_s * 1e3:.2f} ms if prompt and decode rows mix"
                           if fit.mixed_s else "")
                        + (f"; {fit.overhead_s * 1e3:.2f} ms per request outside its steps"
                           if fit.overhead_s else ""))
    for col in ("point", "measured ms", "fit ms", "error"):
        table.add_column(col, justify="left" if col == "point" else "right")
    for r in rows:
        table.add_row(r["point"], f"{r['measured_ms']:.2f}", f"{r['fit_ms']:.2f}",
                      f"{r['error_pct']:+.1f}%")
    out.print(table)


def _from_server(url: str, model: str, api_key: str | None, model_profile: str | None,
                 like: str, hardware: str | None, name: str | None, quick: bool,
                 as_json: bool) -> None:
    """`calibrate --url`: probe the server, fit, write a model and a hardware profile."""
    from kvdeck.runtime.planning.calibrate import fit_step_model
    from kvdeck.runtime.planning.probe import (
        FULL,
        QUICK,
        probe,
        server_name,
        write_server_profiles,
    )
    from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile

    base = guarded(lambda: ModelProfile.load(model_profile or model))
    card = guarded(lambda: HardwareProfile.load(like))
    hw = hardware or server_name(url)
    profile = name or f"{base.name}-{hw}"
    say = (lambda msg: None) if as_json else out.print
    say(f"probing {url} ({model}) from outside")
    points = guarded(lambda: probe(url, model, QUICK if quick else FULL, api_key, say,
                                   shape=base))
    fit = fit_step_model(points)
    model_file, hw_file = write_server_profiles(url, base, profile, hw, fit, points, card)
    rows = _rows(points, fit)
    wake = [{"idle_s": p.idle_s, "extra_ms": p.seconds * 1e3}
            for p in points if p.kind == "wake"]
    saves = [{"tokens": p.new_tokens, "ms": p.seconds * 1e3}
             for p in points if p.kind == "save"]
    if as_json:
        print_json({"fit": fit.to_json(), "points": rows, "wake": wake, "slot_save": saves,
                    "model_profile": str(model_file), "hardware_profile": str(hw_file),
                    "url": url})
        return
    _table(rows, fit)
    if wake:
        out.print("first step after an idle spell, beyond the same step back to back: "
                  + ", ".join(f"{w['extra_ms']:+.1f} ms after {w['idle_s']:g} s" for w in wake),
                  highlight=False)
    for save in saves:
        out.print(f"saving an idle slot of {save['tokens']:,} tokens to the prompt cache: "
                  f"{save['ms']:.1f} ms", highlight=False)
    out.print(f"wrote {model_file} and {hw_file}; predict a trace with them: kvdeck run-trace "
              f"TRACE --model-profile {profile} --hardware {hw} --timing fit", highlight=False)
