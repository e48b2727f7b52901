"""`kvdeck scenario list` and `kvdeck scenario run NAME`: the source chapters' worked
examples, computed by kvdeck and set beside the chapter's figures
(`runtime/planning/scenarios.py`)."""

from __future__ import annotations

import math

import typer

from kvdeck.console.commands.common import fail, guarded, out, print_json

app = typer.Typer(help="The source chapters' worked examples, run through kvdeck's planner, "
                       "step model and sim, beside the chapter's figures.",
                  no_args_is_help=True)


@app.command("list")
def list_scenarios(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Every scenario: its name, source and title."""
    from kvdeck.runtime.planning.scenarios import Scenario, scenario_names

    scenarios = [guarded(lambda n=n: Scenario.load(n)) for n in scenario_names()]
    if as_json:
        print_json([{"name": s.name, "source": s.source, "title": s.title, "kind": s.kind}
                    for s in scenarios])
        return
    from rich.table import Table

    table = Table()
    for col in ("scenario", "title", "source"):
        table.add_column(col)
    for s in scenarios:
        table.add_row(s.name, s.title, s.source)
    out.print(table)


@app.command("run")
def run_scenario(
    name: str = typer.Argument(..., help="A scenario's name (kvdeck scenario list)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    console: bool = typer.Option(False, "--console", help="Then run the plan's chosen scheme "
                                 "in the sim, recorded, and open the run in the console "
                                 "(plan scenarios)."),
    record: str = typer.Option(None, "--record", help="Record that run here (default: a "
                               "temporary folder; implies the run, not the console)."),
) -> None:
    """Compute one scenario's figures and set them beside the chapter's; exit 1 when a
    figure is outside its tolerance."""
    from rich.table import Table

    from kvdeck.runtime.planning.scenarios import Scenario, scenario_names

    if name not in scenario_names():
        fail(f"No scenario {name!r}; kvdeck scenario list names them: "
             f"{', '.join(scenario_names())}.")
    scenario = guarded(lambda: Scenario.load(name))
    figures = guarded(scenario.run)
    if as_json:
        print_json({"name": scenario.name, "source": scenario.source, "note": scenario.note,
                    "figures": [{"name": f.name, "chapter": f.chapter, "kvdeck": f.kvdeck,
                                 "tolerance": f.tolerance, "holds": f.holds,
                                 "calibration": f.calibration,
                                 "inconsistent": f.inconsistent}
                                for f in figures]})
    else:
        out.print(f"[bold]{scenario.title}[/] [dim]({scenario.source})[/]", highlight=False)
        table = Table()
        for col in ("figure", "chapter", "kvdeck", "off by", "tolerance", ""):
            table.add_column(col, justify="left" if col in ("figure", "") else "right")
        for f in figures:
            words = isinstance(f.chapter, str) or isinstance(f.kvdeck, str)
            off = "" if words or not f.chapter or not math.isfinite(f.kvdeck) else \
                f"{100 * (f.kvdeck - f.chapter) / abs(f.chapter):+.1f} %"
            verdict = "[yellow]chapter inconsistent[/]" if f.inconsistent and not f.holds \
                else "[green]holds[/]" if f.holds else "[red]misses[/]"
            table.add_row(f.name, _show(f.chapter), _show(f.kvdeck), off,
                          "equal" if words else f"{100 * f.tolerance:g} %",
                          verdict + (" [dim](calibration)[/]" if f.calibration else ""))
        out.print(table)
        if any(f.calibration for f in figures):
            out.print("calibration: a figure a profile's measurement was taken from, "
                      "reproduced rather than predicted.", highlight=False)
        if scenario.note:
            out.print(" ".join(scenario.note.split()), highlight=False)
    if console or record:
        _run_recorded(scenario, record, console, as_json)
    if not all(f.holds != f.inconsistent for f in figures):
        raise typer.Exit(1)


def _run_recorded(scenario, record: str | None, console: bool, as_json: bool) -> None:
    """Run the scenario's chosen scheme in the sim, recorded; open it in the console."""
    import tempfile

    from kvdeck.runtime.planning.scenario_run import record_scenario

    folder = record or tempfile.mkdtemp(prefix=f"kvdeck-{scenario.name}-")
    scheme, summary = guarded(lambda: record_scenario(scenario.kind, scenario.setup, folder))
    if not as_json:
        out.print(f"ran {scheme} in the sim: TTFT p50 {summary['ttft_s']['p50']:.2f} s, "
                  f"completion {summary['makespan_s']:.2f} s; recorded in {folder}",
                  highlight=False)
    if console:
        from kvdeck.console.screens.replay import ReplayApp

        app = guarded(lambda: ReplayApp(folder))
        app.run()
        if app.problem is not None:
            fail(app.problem)


def _show(value: float | str) -> str:
    if isinstance(value, str):
        return value
    if not math.isfinite(value):
        return "∞" if value > 0 else "−∞" if value < 0 else "—"
    return f"{value:,.0f}" if value == int(value) and abs(value) >= 100 else f"{value:,.4g}"
