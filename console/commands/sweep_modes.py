"""`kvdeck sweep --batch B1,B2,...` and `kvdeck sweep --admission M1,M2,...`: the source
chapter's batch-size and admission-mode sweeps, run in this process
(`runtime/planning/batch_sweep.py`)."""

from __future__ import annotations

from kvdeck.console.commands.common import err, fail, guarded, out, print_json
from kvdeck.console.options import SettingsRequest
from kvdeck.runtime.errors import ConfigError


def refuse_mixed(batch, admission, trace, rates, url, svg) -> None:
    """One sentence and exit 2 where `--batch` or `--admission` is given with what it does
    not take."""
    if (batch or admission) and (url or svg is not None or (batch and admission)):
        fail("--batch and --admission run in this process, one at a time, without --url or "
             "--svg.")
    if batch and (trace is not None or rates is not None):
        fail("--batch sends its own requests (--prompt-len, --output-len, all at once): it "
             "takes no trace and no --rates.")


def parse_batches(text: str) -> list[int]:
    """`--batch` as two or more different batch sizes from 1 to 4,096."""
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        raise ConfigError(f"--batch must be comma-separated whole numbers, got {text!r}.") \
            from None
    if len(set(batches)) < 2 or len(set(batches)) != len(batches) or \
            any(not 1 <= b <= 4096 for b in batches):
        raise ConfigError(f"--batch needs at least two different batch sizes from 1 to 4096, "
                          f"got {text!r}.")
    return batches


def parse_modes(text: str) -> list[str]:
    """`--admission` as known admission modes, each once."""
    from kvdeck.runtime.planning.batch_sweep import ADMISSION_MODES

    modes = [m.strip() for m in text.split(",")]
    unknown = [m for m in modes if m not in ADMISSION_MODES]
    if unknown or len(set(modes)) != len(modes):
        raise ConfigError(f"--admission takes {', '.join(ADMISSION_MODES)}, each once, "
                          f"comma-separated; got {text!r}.")
    return modes


def run_batches(text: str, prompt_len: int, output_len: int, settings: SettingsRequest,
                as_json: bool) -> None:
    """Each batch size `--batch` names through a fresh engine; a table (or JSON) of the
    points."""
    from kvdeck.console.sweep_report import render_batches
    from kvdeck.runtime.core.config import check_int
    from kvdeck.runtime.planning.batch_sweep import batch_sweep

    batches = guarded(lambda: parse_batches(text))
    guarded(lambda: check_int("--prompt-len", prompt_len, 1, 1 << 20))
    guarded(lambda: check_int("--output-len", output_len, 1, 1 << 20))

    def run(arrivals: list) -> tuple:
        from kvdeck.runtime.executors.base import Modelled, has
        from kvdeck.runtime.planning.profiles import HardwareProfile
        from kvdeck.runtime.runs.runner import run_arrivals
        from kvdeck.runtime.session import build_session

        fixed = {"max_num_seqs": max(len(arrivals), 1)}
        session = build_session(settings.resolve("sim", **fixed), with_tokenizer=False)
        try:
            records: list = []
            engine = session.engine

            def keep(e) -> None:
                record = e.last_step[0] if e.last_step else None
                if record is not None and (not records or records[-1] is not record):
                    records.append(record)

            result = run_arrivals(engine, arrivals, vocab_size=session.vocab_size,
                                  on_step=keep)
            ex = engine.executor
            # The sim's card, else this machine's read bandwidth measured once.
            bandwidth = ex.hardware.bandwidth_bytes_per_s if has(ex, Modelled) else \
                HardwareProfile.load("local").bandwidth_bytes_per_s
            return result["requests"], records, bandwidth
        finally:
            session.close()

    say = (lambda msg: None) if as_json else (lambda msg: err.print(msg, highlight=False))
    points = guarded(lambda: batch_sweep(run, batches, prompt_len, output_len, progress=say))
    if as_json:
        print_json({"prompt_len": prompt_len, "output_len": output_len,
                    "points": [p.to_json() for p in points]})
        return
    render_batches(out, f"batch sweep: {prompt_len} in / {output_len} out, all at once",
                   points)


def run_modes(modes: list[str], arrivals: list, rates: tuple, run, title: str,
              as_json: bool) -> None:
    """Each admission mode's rate sweep, `run(arrivals, the mode's knobs)` giving a run's
    summary; a table (or JSON) of goodput per mode and rate."""
    from kvdeck.console.sweep_report import render_modes
    from kvdeck.runtime.planning.batch_sweep import admission_sweep

    say = (lambda msg: None) if as_json else (lambda msg: err.print(msg, highlight=False))
    result = guarded(lambda: admission_sweep(run, modes, arrivals, rates, progress=say))
    if as_json:
        print_json({mode: [p.to_json() for p in points] for mode, points in result.items()})
        return
    render_modes(out, title, result)
